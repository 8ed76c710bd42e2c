"""Module size, for every module of every package: at most 400 lines; over 300 is noted, not failed.

The house rule: one noun per module, aim for <= 300 lines, look hard at anything over 500; this
package holds itself to 400 (its folders by concern keep modules small). The note lists the
modules between the aim and the limit, longest first (pytest -s or -rA shows it; it is also a
warning in the summary), so growth is seen before it reaches the limit.
"""

from __future__ import annotations

import pathlib
import warnings

import plait

ROOT = pathlib.Path(plait.__file__).parent
AIM, LIMIT = 300, 400
TOP_LEVEL, PER_FOLDER = 10, 15  # modules at the top of plait/, and in any one folder


def sizes() -> dict[str, int]:
    """Lines of every module under plait/, by its path relative to plait/."""
    return {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in sorted(ROOT.rglob("*.py"))}


def over(limit: int, found: dict[str, int]) -> list[str]:
    """'path (N lines)' of each module longer than `limit`, longest first."""
    return [f"{path} ({n} lines)" for path, n in sorted(found.items(), key=lambda kv: (-kv[1], kv[0])) if n > limit]


def test_the_check_sees_every_package() -> None:
    found = sizes()
    packages = {path.split("/")[0] for path in found if "/" in path}
    assert packages >= {"capture", "schedule", "plan", "cost", "search", "planner", "runtime", "checkpoint", "job",
                        "cli", "config", "train"}
    assert "model.py" in found and "config/config.py" in found and "runtime/tp/tensor_parallel.py" in found


def test_no_module_is_over_the_limit() -> None:
    too_long = over(LIMIT, sizes())
    assert not too_long, f"modules over {LIMIT} lines (split them by noun): {too_long}"


def test_modules_over_the_aim_are_noted() -> None:
    noted = over(AIM, sizes())
    if noted:
        note = f"{len(noted)} modules over the aim of {AIM} lines: " + ", ".join(noted)
        print(note)
        warnings.warn(note, stacklevel=1)


def folders(found: dict[str, int]) -> dict[str, int]:
    """Modules (counting `__init__`) of each folder, by its path relative to plait/ ("" the top level)."""
    out: dict[str, int] = {}
    for path in found:
        folder = path.rsplit("/", 1)[0] if "/" in path else ""
        out[folder] = out.get(folder, 0) + 1
    return out


def test_the_top_level_is_the_public_face() -> None:
    # the package's top level is its public face: a handful of modules; the rest live in folders by concern
    top = sorted(path for path in sizes() if "/" not in path)
    assert len(top) <= TOP_LEVEL, f"{len(top)} modules at the top of plait/ (at most {TOP_LEVEL}): {top}"


def test_no_folder_is_a_grab_bag() -> None:
    crowded = {folder: n for folder, n in folders(sizes()).items() if folder and n > PER_FOLDER}
    assert not crowded, f"folders of more than {PER_FOLDER} modules (split them by concern): {crowded}"


def test_folders_counts_each_folders_modules() -> None:
    assert folders({"a.py": 1, "x/b.py": 1, "x/c.py": 1, "x/y/d.py": 1}) == {"": 1, "x": 2, "x/y": 1}


def test_the_schedule_package_keeps_to_the_aim() -> None:
    # the pure schedules were written to the aim and have stayed there: keep it a rule for them
    long_ones = over(AIM, {p: n for p, n in sizes().items() if p.startswith("schedule/")})
    assert not long_ones, long_ones


def test_over_lists_the_longest_first() -> None:
    assert over(300, {"a.py": 301, "b.py": 300, "c.py": 450, "d.py": 301}) == [
        "c.py (450 lines)", "a.py (301 lines)", "d.py (301 lines)"]
