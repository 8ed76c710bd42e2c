"""The options `plait run` passes to every rank's `Config`, read here and nowhere else.

`plait run` reaches the ranks' scripts only through their environment, so each option it
passes is one variable, set by the command (`plait.cli.main`) and applied by `Model` to the
config fields the user left open (None); a value the user gave wins:

    plait run --replan      PLAIT_REPLAN=1      Config(replan=None) -> replan=True

Without `plait run` (torchrun, mpirun, Slurm, one process) nothing is set, and the open fields
take their defaults (replan=False).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Mapping

from plait.config import Config

__all__ = ["REPLAN_ENV", "run_options_env", "apply_run_options"]

REPLAN_ENV = "PLAIT_REPLAN"


def run_options_env(replan: bool) -> dict[str, str]:
    """The variables `plait run` sets for its ranks."""
    return {REPLAN_ENV: "1"} if replan else {}


def apply_run_options(config: Config, environ: Mapping[str, str] | None = None) -> Config:
    """`config` with the fields left open (None) set from `plait run`'s options, else their defaults."""
    env = os.environ if environ is None else environ
    if config.replan is None:
        config = replace(config, replan=env.get(REPLAN_ENV) == "1")
    return config
