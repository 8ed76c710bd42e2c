"""Developer entry point: set up the project's virtual environment, then run the demo or the tests.

Usage (any Python >= 3.10, standard library only):

    python3 dev.py demo [plait demo options]    # e.g. python3 dev.py demo --epochs 2
    python3 dev.py test [pytest options]        # e.g. python3 dev.py test -k launch

The test summary gives the reason of every skipped test. With PLAIT_NO_SKIP=1 (as CI runs it)
a skip fails instead (tests/conftest.py).

The environment lives in `.venv` beside this file. It is built once: torch is pinned to the CPU
build first (a bare `torch` requirement could make pip resolve a multi-GB CUDA build), then plait
is installed in editable mode with its `dev` extra. A stamp file holding a hash of
pyproject.toml (and of the pins below) makes later runs start at once; editing either reinstalls.

The tests also train the Hugging Face architectures under a transformers 4.x release, which many
users still pin (its model code differs from 5.x's): `TRANSFORMERS_4` is installed, without
dependencies, into `.venv/transformers-4`, which those tests put first on the path of a child
process (PLAIT_TRANSFORMERS_4 names the folder).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

__all__ = ["main"]

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".plait-installed"
TORCH_PIN = "torch==2.13.0"  # the CPU build; see the module docstring
# transformers 4.57.6 and the packages it needs at the versions 4.x accepts (the venv's others,
# numpy, safetensors, regex, pyyaml, tqdm, filelock, fsspec, packaging, idna, serve both)
TRANSFORMERS_4 = ["transformers==4.57.6", "huggingface_hub==0.36.2", "tokenizers==0.22.2", "requests==2.34.2",
                  "urllib3==2.8.0", "certifi==2026.10.19.post1", "charset_normalizer==3.5.3"]
TRANSFORMERS_4_DIR = VENV / "transformers-4"


def _bin(name: str) -> Path:
    scripts = "Scripts" if os.name == "nt" else "bin"
    suffix = ".exe" if os.name == "nt" else ""
    return VENV / scripts / f"{name}{suffix}"


def _wanted_stamp() -> str:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + repr(TRANSFORMERS_4).encode()).hexdigest()
    return f"{digest}\n"


def _run(cmd: list[str]) -> None:
    """Run a setup step; stop with its exit code if it fails."""
    code = subprocess.call(cmd, cwd=ROOT)
    if code != 0:
        print(f"dev.py: setup step failed with exit code {code}: {' '.join(cmd)}", file=sys.stderr)
        sys.exit(code)


def ensure_venv() -> Path:
    """Create or reuse `.venv` with torch (CPU) and plait[dev]; return its python."""
    python = _bin("python")
    if not python.exists():
        print(f"dev.py: creating virtual environment in {VENV.name}/", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(VENV)
    if STAMP.exists() and STAMP.read_text() == _wanted_stamp():
        return python

    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    has_torch = subprocess.call(
        [str(python), "-c", "import torch"], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ) == 0
    if not has_torch:
        print(f"dev.py: installing {TORCH_PIN}", file=sys.stderr)
        _run(pip + [TORCH_PIN])
    print("dev.py: installing plait (editable) with its dev extra", file=sys.stderr)
    _run(pip + ["-e", ".[dev]"])
    print("dev.py: installing transformers 4.x beside it, for the tests", file=sys.stderr)
    _run(pip + ["--upgrade", "--no-deps", "--target", str(TRANSFORMERS_4_DIR), *TRANSFORMERS_4])
    STAMP.write_text(_wanted_stamp())
    return python


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in ("demo", "test"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    command, rest = args[0], args[1:]
    python = ensure_venv()
    if command == "demo":
        return subprocess.call([str(_bin("plait")), "demo", *rest], cwd=ROOT)
    # -rsx: the summary lists every skipped test and expected failure with its reason.
    env = {**os.environ, "PLAIT_TRANSFORMERS_4": str(TRANSFORMERS_4_DIR)}
    return subprocess.call([str(python), "-m", "pytest", "-q", "-rsx", *rest], cwd=ROOT, env=env)


if __name__ == "__main__":
    if sys.version_info < (3, 10):
        sys.exit(f"dev.py needs Python >= 3.10 (this is {sys.version.split()[0]})")
    sys.exit(main())
