"""Tests for plait.config.run_options: `plait run`'s options reach the config fields left open, and only those."""

from __future__ import annotations

from plait.config import Config
from plait.config.run_options import REPLAN_ENV, apply_run_options, run_options_env


def test_plait_run_replan_sets_one_variable() -> None:
    assert run_options_env(replan=True) == {REPLAN_ENV: "1"} and REPLAN_ENV == "PLAIT_REPLAN"
    assert run_options_env(replan=False) == {}


def test_an_open_replan_follows_plait_run() -> None:
    assert apply_run_options(Config(), {REPLAN_ENV: "1"}).replan is True
    assert apply_run_options(Config(), {}).replan is False
    assert apply_run_options(Config(), {REPLAN_ENV: "yes"}).replan is False  # only "1" turns it on


def test_a_replan_the_user_gave_wins() -> None:
    assert apply_run_options(Config(replan=False), {REPLAN_ENV: "1"}).replan is False
    assert apply_run_options(Config(replan=True), {}).replan is True


def test_other_fields_are_kept() -> None:
    config = Config(num_stages=2, dp=3, seed=7)
    applied = apply_run_options(config, {REPLAN_ENV: "1"})
    assert (applied.num_stages, applied.dp, applied.seed) == (2, 3, 7)
