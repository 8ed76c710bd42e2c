"""Checkpoints and exports of stages of different widths (Config.stage_tp, Config.stage_dp)
load into any layout, and any layout's into them: 3 ranks, Hugging Face GPT-2 with Adam.

Each case trains 2 steps in one layout, saves a checkpoint and exports Hugging Face sharded
safetensors, resumes the 3rd step in another layout from the checkpoint (parameters and Adam state
by name, whatever split them), and loads the export into a third
(`tests.test_tensor_parallel._save_and_resume`); every rank compares the losses and the gathered
state with one process (fp32, atol 2e-5), and `from_pretrained` reads the export whole."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import run_ranks
from tests.test_tensor_parallel import _save_and_resume

TP_2_1 = {"stage_tp": (2, 1), "layers_per_stage": (12, 11)}
TP_1_2 = {"stage_tp": (1, 2), "layers_per_stage": (9, 14), "crossing": "whole"}
DP_2_1 = {"stage_dp": (2, 1), "layers_per_stage": (12, 11), "zero": 1}  # 6-row steps: 1 row a replica; ZeRO-1
DP_1_2 = {"stage_dp": (1, 2), "layers_per_stage": (9, 14), "num_microbatches": 2}  # 4 rows: 2 a micro-batch
PP_3 = {"layers_per_stage": (8, 8, 7)}

CASES = {  # saved in, resumed in, the export loaded into
    "tp21-to-pp3": (TP_2_1, PP_3, DP_1_2),
    "dp21-to-tp12": (DP_2_1, TP_1_2, TP_2_1),
    "tp12-to-itself": (TP_1_2, TP_1_2, PP_3),  # the same layout: its RNG states restored too
}


def _cases(rank: int, world: int, root: str) -> dict[str, list[str]]:
    return {name: _save_and_resume(rank, world, f"{root}/{name}", *layouts) for name, layouts in CASES.items()}


@pytest.mark.timeout(600)
def test_checkpoints_of_stages_of_different_widths_resume_in_any_layout(tmp_path: Any) -> None:
    report = run_ranks(3, _cases, str(tmp_path), timeout=580)
    for rank, results in enumerate(report):
        assert set(results) == set(CASES), rank
        for name, problems in results.items():
            assert not problems, f"rank {rank} {name}:\n" + "\n".join(problems)
