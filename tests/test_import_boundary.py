"""The import layers: no module imports one above its own layer, no import cycle, and the pure code never
talks to other ranks.

The layers, bottom to top (a package imports only from its own layer or below, and within a layer only
along the order written here, so that the packages form a chain, never a loop):

    base        errors, data, metrics, callbacks, tensor_parts, materialize, host
                                                          (the top-level modules but model)
    pure        capture, schedule, plan, cost, search     (no torch.distributed; the plan is data, the
                                                          cost model prices it, the search chooses it)
    config      config                                    (the user's Config: the planner's input; nothing
                                                          below the planner reads it, only the Plan)
    job-side    runtime, job -> planner, checkpoint       (planner and checkpoint use runtime's
                                                          collectives; planner reads job's ranks)
    model       train -> model                            (the public Model; train holds its parts: the start
                                                          on a rank, the pipeline's build, the fit loop, export)
    cli         cli                                       (the `plait` command)
"""

import ast
import pathlib

import plait

ROOT = pathlib.Path(plait.__file__).parent

# Each unit (a package, or a top-level module) and what it may import besides itself.
BASE = {"errors", "data", "metrics", "callbacks", "tensor_parts", "materialize", "host"}
PURE_PLANNING = {"schedule", "plan", "cost", "search"}
ALLOWED = {
    "errors": set(),
    "config": BASE | {"capture", "schedule", "plan"},
    "data": {"errors"},
    "metrics": {"errors"},
    "callbacks": set(),
    "materialize": {"errors", "tensor_parts"},
    "tensor_parts": set(),
    "host": set(),
    "capture": BASE,
    "schedule": BASE,
    "plan": BASE | {"schedule"},
    "cost": BASE | {"schedule", "plan"},
    "search": BASE | {"schedule", "plan", "cost"},
    "runtime": BASE | {"capture"} | PURE_PLANNING,
    "planner": BASE | {"config", "capture", "runtime", "job"} | PURE_PLANNING,
    "checkpoint": BASE | {"config", "runtime"},
    "job": BASE,
    "train": BASE | {"config", "capture", "runtime", "planner", "checkpoint", "job"} | PURE_PLANNING,
    "model": BASE | {"config", "capture", "runtime", "planner", "checkpoint", "job", "train"} | PURE_PLANNING,
    "cli": BASE | {"config", "capture", "runtime", "planner", "checkpoint", "job", "model", "__init__"} | PURE_PLANNING,
    "__init__": BASE | {"config", "model", "plan", "job"},
}
PURE = ["capture", "schedule", "plan", "cost", "search", "errors", "config", "data", "metrics", "materialize.py", "tensor_parts.py", "checkpoint/disk.py",
        "checkpoint/tensorfile.py", "checkpoint/train_state.py", "checkpoint/resume.py", "checkpoint/weights.py"]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> set[str]:
    """Every module `path` imports, `from a import b` counted as `a.b` when `a/b.py` exists."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            for alias in node.names:
                sub = ROOT.parent / (node.module.replace(".", "/") + "/" + alias.name)
                if sub.with_suffix(".py").exists() or (sub / "__init__.py").exists():
                    names.add(f"{node.module}.{alias.name}")
                else:
                    names.add(node.module)
    return names


def unit(module: str) -> str:
    """The layer unit of a plait module: its package, or the top-level module's own name."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def modules() -> dict[str, set[str]]:
    graph = {}
    for f in sorted(ROOT.rglob("*.py")):
        graph[module_name(f)] = {m for m in imports(f) if m == "plait" or m.startswith("plait.")}
    return graph


def test_every_unit_has_a_layer():
    units = {unit(m) for m in modules()}
    assert units <= set(ALLOWED), units - set(ALLOWED)


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    offenders = {}
    for module, deps in graph.items():
        own = unit(module)
        bad = {d for d in deps if unit(d) != own and unit(d) not in ALLOWED[own]}
        if bad:
            offenders[module] = sorted(bad)
    return offenders


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """The first import cycle found by a depth-first walk, as a path, or None."""
    known = set(graph)

    def resolve(dep):  # `plait.plan` names the package's __init__
        return dep if dep in known else dep.rsplit(".", 1)[0]

    state = {}

    def visit(node, stack):
        state[node] = "open"
        for dep in sorted(resolve(d) for d in graph.get(node, ())):
            if dep == node or dep not in known:
                continue
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, stack + [dep])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_no_import_runs_up_the_layers():
    offenders = upward_imports(modules())
    assert not offenders, offenders


def test_the_layer_table_is_a_chain_without_loops():
    # "No upward import" is only a layering if the table of allowed imports has no loop itself.
    table = {name: {f"plait.{d}" for d in deps} for name, deps in ALLOWED.items()}
    assert find_cycle({f"plait.{k}": v for k, v in table.items()}) is None


def test_nothing_below_the_planner_reads_the_config():
    # The user's Config is the planner's input; below the planner only the Plan travels. The story:
    # the pure layers and the runtime each read a few layout facts from Config (the schedule names,
    # crossing, tp_plan, sequence_parallel), so the Plan was not the whole of a run's layout.
    below = {"capture", "schedule", "plan", "cost", "search", "runtime", "job"}
    readers = {m: sorted(d for d in deps if unit(d) == "config") for m, deps in modules().items() if unit(m) in below}
    assert not {m: d for m, d in readers.items() if d}, readers


def model_privates(tree: ast.AST) -> list[str]:
    """`model._name` reads in a module (a Model's private parts, reached from outside it)."""
    return [f"{node.lineno}: model.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "model"
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def test_no_module_reads_the_models_private_parts():
    # The story: the fit loop (train/fit_loop) ran the Model's _run, _runner, _save, _restore and read
    # _train and _checkpoints; Model.fit now hands it the steps it runs (train.fit_loop.FitSteps).
    found = {str(f.relative_to(ROOT)): model_privates(ast.parse(f.read_text()))
             for f in sorted(ROOT.rglob("*.py")) if f != ROOT / "model.py"}
    assert not {name: lines for name, lines in found.items() if lines}, found
    assert model_privates(ast.parse("model._run(x)\nmodel.fit(x)\nmodel.__class__")) == ["1: model._run"]


def test_no_module_import_cycle():
    cycle = find_cycle(modules())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checks_see_a_planted_cycle_and_an_upward_import():
    assert find_cycle({"plait.a": {"plait.b"}, "plait.b": {"plait.c"}, "plait.c": {"plait.a"}}) == [
        "plait.a", "plait.b", "plait.c", "plait.a"]
    assert find_cycle({"plait.a": {"plait.b"}, "plait.b": set()}) is None
    assert upward_imports({"plait.planner.replan": {"plait.model", "plait.cost.prediction"}}) == {
        "plait.planner.replan": ["plait.model"]}


def test_pure_packages_do_not_import_torch_distributed():
    offenders = {}
    for entry in PURE:
        target = ROOT / (entry if entry.endswith(".py") else entry)
        files = ([target] if target.suffix == ".py" else sorted(target.rglob("*.py"))) if target.exists() \
            else [ROOT / f"{entry}.py"]
        assert all(f.exists() for f in files), entry
        for f in files:
            bad = {m for m in imports(f) if m.startswith("torch.distributed") or m.startswith("plait.runtime")}
            if bad:
                offenders[str(f.relative_to(ROOT))] = bad
    assert not offenders, offenders


PICKLING_CALLS = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                  "send_object_list", "recv_object_list", "load", "loads"}


def test_nothing_on_the_wire_or_on_disk_is_unpickled():
    # The story: the network calibration gathered host names with all_gather_object and shared
    # the cached link with broadcast_object_list -- both pickle, on every multi-rank planned run.
    # torch.load is allowed only with weights_only=True; pickle itself never.
    offenders = []
    for f in sorted(ROOT.rglob("*.py")):
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
