"""Tests for plait.job.hostlist: Slurm's host lists and tasks-per-node strings, expanded in order."""

from __future__ import annotations

import pytest

from plait.errors import ConfigError
from plait.job.hostlist import expand_nodelist, expand_tasks_per_node


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("a[098-101]", ["a098", "a099", "a100", "a101"]),
        ("rack[1-2]-n[0-1]", ["rack1-n0", "rack1-n1", "rack2-n0", "rack2-n1"]),
        ("x-1,y[2]", ["x-1", "y2"]),
        (" node[1-2] ", ["node1", "node2"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, message", [
    ("node[1-2", "unclosed"), ("node[[1]]", "nested"), ("node]1[", "unbalanced"),
    ("node[3-1]", "runs backwards"), ("node[a-b]", "is not a number"), ("a,,b", "empty entry"),
])
def test_expand_nodelist_rejects_malformed_lists(nodelist: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        expand_nodelist(nodelist)


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    assert expand_tasks_per_node(" 3(x2) , 1(x1)") == [3, 3, 1]


@pytest.mark.parametrize("spec, item", [("4(3)", "4(3)"), ("2,x", "x"), ("", ""), ("2(x)", "2(x)")])
def test_expand_tasks_per_node_names_the_bad_item(spec: str, item: str) -> None:
    with pytest.raises(ConfigError) as info:
        expand_tasks_per_node(spec)
    assert str(info.value) == f"tasks per node {spec!r}: {item!r} is not N or N(xM)"


def test_error_messages_quote_the_whole_list_and_the_bad_part() -> None:
    with pytest.raises(ConfigError) as info:
        expand_nodelist("gpu[01-03,x7]")
    assert str(info.value) == "Slurm node list 'gpu[01-03,x7]': 'x7' is not a number or a range a-b"
    with pytest.raises(ConfigError) as info:
        expand_nodelist("n[5-2]")
    assert str(info.value) == "Slurm node list 'n[5-2]': range '5-2' runs backwards"


def test_a_range_keeps_the_width_of_its_first_bound() -> None:
    assert expand_nodelist("n[7-9,010]") == ["n7", "n8", "n9", "n010"]
    assert expand_nodelist("n[9-11]") == ["n9", "n10", "n11"]  # no padding: the first bound has one digit
