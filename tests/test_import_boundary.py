"""Plan, schedule and capture code never import torch.distributed; only the runtime talks to other ranks."""

import ast
import pathlib

import plait

PURE = ["plan", "schedule", "capture", "config.py", "errors.py", "data.py", "metrics.py",
        "tensorfile.py", "checkpoint.py", "train_state.py", "resume.py"]


def imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_pure_packages_do_not_import_torch_distributed():
    root = pathlib.Path(plait.__file__).parent
    offenders = {}
    for entry in PURE:
        files = [root / entry] if entry.endswith(".py") else sorted((root / entry).rglob("*.py"))
        assert files, entry
        for f in files:
            bad = {m for m in imports(f) if m.startswith("torch.distributed") or m.startswith("plait.runtime")}
            if bad:
                offenders[str(f.relative_to(root))] = bad
    assert not offenders, offenders
