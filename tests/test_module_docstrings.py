"""Every module under plait/ starts with a docstring whose first line is one sentence (house rule 2)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import plait

ROOT = pathlib.Path(plait.__file__).parent
# A sentence ends at ".", "!" or "?" followed by a space and a capital: "Done. Next" is two.
SENTENCE_BREAK = re.compile(r"[.!?]\s+[A-Z]")


def docstring_problem(source: str) -> str | None:
    """Why `source` does not open with a one-sentence summary line, or None when it does."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    if doc is None:
        return "no module docstring"
    lines = doc.split("\n")
    summary = lines[0].strip()
    if not summary:
        return "the docstring's first line is empty; put the summary right after the quotes"
    if len(lines) > 1 and lines[1].strip():
        return f"the summary runs onto a second line ({lines[1].strip()[:40]!r}); keep it to one line"
    if not summary.endswith("."):
        return f"the summary {summary!r} does not end with a period"
    if SENTENCE_BREAK.search(summary):
        return f"the summary {summary!r} is more than one sentence"
    return None


def test_every_module_opens_with_a_one_sentence_summary() -> None:
    modules = sorted(ROOT.rglob("*.py"))
    assert len(modules) > 60
    problems = {str(f.relative_to(ROOT)): docstring_problem(f.read_text()) for f in modules}
    bad = {path: why for path, why in problems.items() if why}
    assert not bad, bad


@pytest.mark.parametrize("source, problem", [
    ('"""Batches and micro-batches."""\nx = 1\n', None),
    ('"""Checkpoints on disk: a directory per step.\n\nMore text. Any number of sentences.\n"""\n', None),
    ("x = 1\n", "no module docstring"),
    ('import os\n"""Too late."""\n', "no module docstring"),
    ('"""\nSummary on the second line.\n"""\n', "the docstring's first line is empty; put the summary right "
                                               "after the quotes"),
    ('"""Starts here and\ngoes on."""\n', "the summary runs onto a second line ('goes on.'); keep it to one line"),
    ('"""No period"""\n', "the summary 'No period' does not end with a period"),
    ('"""One. Two."""\n', "the summary 'One. Two.' is more than one sentence"),
])
def test_the_check_itself(source: str, problem: str | None) -> None:
    assert docstring_problem(source) == problem
