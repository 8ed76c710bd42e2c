"""Tests for plait.runtime.output_rows: predict joins per-row output leaves along the rows and
returns the others per micro-batch; a rank that fails to join its outputs stops every other rank.

The story: CLIP's `logits_per_image` is (rows x rows) per micro-batch. predict joined every leaf
along dim 0: micro-batches of 2/1/1 rows failed on the last stage's rank (and equal ones would
have made a wrong (6 x 2)), and that rank raised without a word to the others, so rank 0 waited
out timeout_s for its outputs ("no report from ranks [1]").
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import plait
from plait.capture.trace import capture_batch
from plait.errors import PipelineError
from plait.runtime.output_rows import join_microbatches, join_parts, leaf_names, row_leaves
from tests.harness import run_ranks


class TwoTowers(nn.Module):
    """CLIP in small: each tower embeds its rows; the logits pair every row with every row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image, self.text = nn.Linear(6, 4), nn.Linear(5, 4)

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> dict[str, torch.Tensor]:
        a, b = self.image(images), self.text(texts)  # (B, 4) each
        return {"logits": a @ b.T, "image_embeds": a, "text_embeds": b}  # (B, B), (B, 4), (B, 4)


def batch(rows: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"images": torch.randn(rows, 6, generator=g), "texts": torch.randn(rows, 5, generator=g)}


def test_the_captured_shapes_say_which_leaves_are_per_row() -> None:
    captured = capture_batch(TwoTowers(), batch(4), train=False)
    assert captured.method == "torch.export"
    assert row_leaves(captured) == (False, True, True)
    assert leaf_names(captured.output_spec) == ["output['logits']", "output['image_embeds']",
                                                "output['text_embeds']"]


def test_per_row_leaves_join_along_the_rows_and_the_others_per_microbatch() -> None:
    mbs = [[torch.ones(2, 2), torch.zeros(2, 3), torch.tensor(1.0)], [torch.ones(1, 1), torch.zeros(1, 3),
                                                                         torch.tensor(2.0)]]
    for per_row in [(False, True, False), None]:  # captured, or read off the shapes (torch.fx)
        joined = join_microbatches(mbs, [2, 1], per_row)
        assert [tuple(v.shape) for v in joined[0]] == [(2, 2), (1, 1)]
        assert tuple(joined[1].shape) == (3, 3) and joined[2].item() == 1.0  # a scalar: the first's
    parts = join_parts([joined, [[torch.ones(3, 3)], torch.zeros(3, 3), torch.tensor(3.0)]])
    assert [tuple(v.shape) for v in parts[0]] == [(2, 2), (1, 1), (3, 3)] and tuple(parts[1].shape) == (6, 3)


def predict_two_towers(rank: int, world: int, fail_join: bool) -> dict[str, object]:
    model = plait.Model(TwoTowers(), plait.Config(layers_per_stage=(1, 1), num_microbatches=3, timeout_s=60.0))
    if fail_join:  # this process only (spawned): the last stage's rank fails joining its outputs
        import plait.runtime.step as step

        def fail(*args: object) -> None:
            raise RuntimeError("Sizes of tensors must match except in dimension 0")

        step.join_microbatches = fail  # type: ignore[assignment]
    start = time.monotonic()
    try:
        out = model.predict(batch(), batch_size=7)
    except PipelineError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"out": out}


@pytest.mark.timeout(90)
def test_predict_returns_per_row_leaves_joined_and_the_others_per_microbatch() -> None:
    x, ref = batch(), TwoTowers().eval()
    with torch.no_grad():
        want = ref(**x)
        blocks = [ref(**{k: v[a:b] for k, v in x.items()})["logits"]  # batches of 7 and 3 rows,
                  for a, b in [(0, 3), (3, 5), (5, 7), (7, 8), (8, 9), (9, 10)]]  # 3 micro-batches each
    for rank, got in enumerate(run_ranks(2, predict_two_towers, False, timeout=80)):
        out = got["out"]
        torch.testing.assert_close(out["image_embeds"], want["image_embeds"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["text_embeds"], want["text_embeds"], rtol=1e-5, atol=1e-6)
        assert [tuple(v.shape) for v in out["logits"]] == [tuple(b.shape) for b in blocks], rank
        for value, block in zip(out["logits"], blocks):
            torch.testing.assert_close(value, block, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(90)
def test_a_rank_that_fails_joining_its_outputs_stops_the_others_at_once() -> None:
    first, last = run_ranks(2, predict_two_towers, True, timeout=80)
    assert last["error"].startswith("rank 1 failed joining its micro-batches' outputs of predict: RuntimeError")
    assert "rank 0 stopped" in first["error"] and "rank 1 failed joining" in first["error"], first["error"]
    assert first["seconds"] < 20, first  # not timeout_s (60 s)
