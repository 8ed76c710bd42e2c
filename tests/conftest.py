"""With PLAIT_NO_SKIP=1 (CI sets it in .ci/run) a skipped test fails, unless its reason is allowed.

CI has everything the suite's promised features need (the MNIST files in ../shared/data/mnist,
`mpirun`, the dev extra's packages): there a skip means a feature went untested, which must
not pass unseen. A reason that may still skip in CI goes on ALLOWED_SKIPS, with why.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import pytest

NO_SKIP_ENV = "PLAIT_NO_SKIP"

# Substrings of skip reasons CI accepts. Empty: no test needs hardware CI lacks (no test needs
# CUDA; every GPU path also runs on CPU).
ALLOWED_SKIPS: tuple[str, ...] = ()


def _no_skip() -> bool:
    return os.environ.get(NO_SKIP_ENV) == "1"


def _reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def _fail_the_skip(report: Any) -> None:
    """Turn a skipped report into a failure that says why, unless its reason is allowed."""
    reason = _reason(report)
    if any(allowed in reason for allowed in ALLOWED_SKIPS):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"{reason}\n{NO_SKIP_ENV}=1: a skip fails here (CI has the data, mpirun and packages every "
        f"test needs); provide what the test needs, or add its reason to ALLOWED_SKIPS in "
        f"tests/conftest.py with why"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if _no_skip() and report.skipped and not hasattr(report, "wasxfail"):
        _fail_the_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if _no_skip() and report.skipped:  # a module-level skip (pytest.importorskip) skips every test in it
        _fail_the_skip(report)
