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


PICKLING_CALLS = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                  "send_object_list", "recv_object_list", "load", "loads"}


def test_nothing_on_the_wire_or_on_disk_is_unpickled():
    # The story: the network calibration gathered host names with all_gather_object and shared
    # the cached link with broadcast_object_list -- both pickle, on every multi-rank planned run.
    # torch.load is allowed only with weights_only=True; pickle itself never.
    root = pathlib.Path(plait.__file__).parent
    offenders = []
    for f in sorted(root.rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(n.split(".")[0] in ("pickle", "cPickle", "dill") for n in names):
                    offenders.append(f"{f.name}:{node.lineno} imports pickle")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                if name in PICKLING_CALLS - {"load", "loads"}:
                    offenders.append(f"{f.name}:{node.lineno} calls {name}")
                if name == "load" and getattr(node.func.value, "id", "") == "torch":
                    safe = any(k.arg == "weights_only" and getattr(k.value, "value", None) is True
                               for k in node.keywords)
                    if not safe:
                        offenders.append(f"{f.name}:{node.lineno} calls torch.load without weights_only=True")
    assert not offenders, offenders
