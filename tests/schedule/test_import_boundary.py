"""The schedule package is pure Python: it imports neither torch nor torch.distributed."""

from __future__ import annotations

import ast
from pathlib import Path

import plait.schedule

PACKAGE = Path(plait.schedule.__file__).parent


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.add(node.module)
    return modules


def test_schedule_imports_no_torch() -> None:
    sources = sorted(PACKAGE.glob("*.py"))
    assert {p.name for p in sources} >= {
        "__init__.py", "action.py", "generators.py", "interleaved.py", "lower.py", "registry.py",
        "simulate.py", "timing.py", "validate.py",
    }
    for path in sources:
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path.name
        for module in imported_modules(path):
            assert module.split(".")[0] != "torch", f"{path.name} imports {module}"
            # other plait packages may import torch; only errors and schedule are allowed
            if module.split(".")[0] == "plait":
                assert module == "plait.errors" or module.startswith("plait.schedule"), (
                    f"{path.name} imports {module}"
                )


def test_public_names() -> None:
    assert sorted(plait.schedule.__all__) == sorted([
        "Op", "Action", "Program", "parse_action", "format_program", "format_grid", "gpipe",
        "one_f_one_b", "zbh1", "interleaved", "forward_only", "generate", "splits_backward",
        "SCHEDULES", "lower_communication", "validate", "simulate", "Simulation", "Event",
    ])
    for name in plait.schedule.__all__:
        assert hasattr(plait.schedule, name)
    assert callable(plait.schedule.simulate)  # the function, not its module
