"""The README's example commands, run as a user runs them: `plait run` on 2 and 4 ranks, then sampling.

The example trained, then crashed sampling text on more than one rank (`Tensor on device meta is
not on the expected device cpu!`): each rank had freed the stages it does not run, and the example
loaded the gathered state into that same module. The commands here are the README's, word for
word; PLAIT_EXAMPLE_EPOCHS=1 only shortens the training (the start-up and the plan are the same).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launching import clean_env

REPO = Path(__file__).resolve().parent.parent
README_COMMANDS = [line.split("#")[0].strip() for line in (REPO / "README.md").read_text().splitlines()
                   if line.startswith(".venv/bin/plait run") and "examples/train.py" in line]


def test_the_readme_shows_both_commands():
    assert README_COMMANDS == [".venv/bin/plait run -n 2 examples/train.py",
                               ".venv/bin/plait run -n 4 examples/train.py --dp 2"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("command", README_COMMANDS)
def test_a_readme_command_trains_and_samples(command):
    argv = shlex.split(command)
    argv[0] = str(Path(sys.executable).parent / "plait")  # this environment's launcher
    done = subprocess.run(argv, cwd=REPO, env=clean_env(PLAIT_EXAMPLE_EPOCHS="1"), capture_output=True,
                          text=True, timeout=380)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "meta parameter" not in output, output[-4000:]  # torch's warning of a load that copied nothing
    losses = re.search(r"on 256 windows ([\d.]+) -> ([\d.]+)", done.stdout)
    assert losses and float(losses[2]) < float(losses[1]), done.stdout
    sample = re.search(r"sample: '(.+)'", done.stdout)
    assert sample and len(sample[1]) == 60, done.stdout
