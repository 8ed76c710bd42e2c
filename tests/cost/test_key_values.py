import pytest

from plait.cost.key_values import integer, key_values
from plait.errors import ConfigError


def test_items_are_read_in_order_with_spaces_and_empty_items_dropped() -> None:
    assert key_values(" a=1, b = x ,,", "--opt", ("a", "b"), "a=A") == {"a": "1", "b": "x"}
    assert key_values("", "--opt", ("a",), "a=A") == {}


@pytest.mark.parametrize("text, item", [("a=1,c=2", "c=2"), ("a", "a")])
def test_an_unknown_key_or_a_missing_value_is_named_with_the_form(text: str, item: str) -> None:
    with pytest.raises(ConfigError, match=f"cannot read '{item}' in --opt '{text}'; write a=A"):
        key_values(text, "--opt", ("a",), "a=A")


def test_integers_are_checked() -> None:
    assert integer("--opt", "a", "12") == 12
    with pytest.raises(ConfigError, match=r"--opt a='1.5' is not an integer"):
        integer("--opt", "a", "1.5")
