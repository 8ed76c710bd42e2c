"""The pure packages (plan, schedule) type-check under mypy --strict."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_pure_packages_pass_mypy_strict():
    pytest.importorskip("mypy")
    result = subprocess.run([sys.executable, "-m", "mypy", "--strict", "plait/plan", "plait/cost", "plait/search", "plait/schedule",
                             "plait/job/ranks.py", "plait/job/hostlist.py"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
