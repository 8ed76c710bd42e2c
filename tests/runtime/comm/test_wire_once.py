"""The wire describes a message once per (peer, key), then sends raw tensors only: counted on a gloo pair.

Every point-to-point message a bare wire posts goes through torch.distributed.isend / irecv; each
rank wraps both and records the dtype and size of every tensor posted (a pipeline's wire, whose
messages may go by shared memory instead, is counted where it posts them: `Wire._isend`). A description is three
messages (int64 header, int64 body, uint8 pytree spec); data is the tensor leaves and one float64
tensor holding the Python-number leaves, the small ones packed into one uint8 message.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

DESCRIPTION = [torch.int64, torch.int64, torch.uint8]


def _count(name: str, log: list[tuple[torch.dtype, int]]) -> None:
    """Record (dtype, bytes) of every tensor torch.distributed.`name` posts, in `log`."""
    import torch.distributed as dist

    original = getattr(dist, name)

    def counted(tensor, *args, **kwargs):
        log.append((tensor.dtype, tensor.numel() * tensor.element_size()))
        return original(tensor, *args, **kwargs)

    setattr(dist, name, counted)


def _count_wire_sends(log: list[tuple[torch.dtype, int]]) -> None:
    """Record (dtype, bytes) of every tensor a Wire sends, whichever way it travels (gloo or ring)."""
    from plait.runtime.comm.wire import Wire

    original = Wire._isend

    def counted(self, tensor, *args, **kwargs):
        log.append((tensor.dtype, tensor.numel() * tensor.element_size()))
        return original(self, tensor, *args, **kwargs)

    Wire._isend = counted


def _message(step: int) -> list:
    """A tensor that requires grad, an int and a float: the same description whatever `step`."""
    return [torch.full((4, 3), float(step)).requires_grad_(), step, step / 2]


def exchange(rank: int, world: int) -> list[list[tuple[torch.dtype, int]]]:
    """Rank 0 sends key "a" three times, key "b" once, key "a" again; rank 1 receives them.
    Returns what each call posted, one list per call."""
    import torch.distributed as dist

    from plait.runtime.comm.wire import Wire

    dist.init_process_group("gloo")
    posted: list[tuple[torch.dtype, int]] = []
    _count("isend" if rank == 0 else "irecv", posted)
    wire = Wire(timeout_s=20)
    calls, keys = [], ["a", "a", "a", "b", "a"]
    for step, key in enumerate(keys):
        start = len(posted)
        if rank == 0:
            wire.send(_message(step) if key == "a" else [torch.arange(5)], 1, key=key, tag=0)
        else:
            values, _ = wire.recv(0, key=key, tag=0)
            want = _message(step) if key == "a" else [torch.arange(5)]
            torch.testing.assert_close(values[0], want[0])
            assert values[1:] == want[1:], (values, want)
        calls.append(posted[start:])
    wire.drain()
    return calls


@pytest.mark.timeout(90)
def test_a_description_travels_once_per_key_then_raw_tensors_only():
    sent, received = run_ranks(2, exchange, timeout=80)
    a_data = [(torch.uint8, 4 * 3 * 4 + 2 * 8)]  # the (4, 3) tensor and the 2 numbers, packed in one message
    b_data = [(torch.int64, 5 * 8)]  # a lone tensor: as it is
    for side, calls in (("sent", sent), ("received", received)):
        dtypes = [[dtype for dtype, _ in call] for call in calls]
        assert dtypes[0] == DESCRIPTION + [d for d, _ in a_data], (side, dtypes)  # key "a": described
        assert calls[1] == calls[2] == calls[4] == a_data, (side, calls)  # "a" again: the raw data only
        assert dtypes[3] == DESCRIPTION + [d for d, _ in b_data], (side, dtypes)  # key "b": described once
        assert calls[3][3:] == b_data, (side, calls)
        assert calls[0][3:] == a_data, (side, calls)


def train_and_count(rank: int, world: int) -> list[list[tuple[torch.dtype, int]]]:
    """Three training steps of a 2-stage pipeline; what each rank's isend posted, step by step."""
    from torch import nn

    import plait
    from tests.models import mlp

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 8, generator=g), torch.randint(0, 4, (30,), generator=g)
    torch.manual_seed(0)
    model = plait.Model(mlp(), plait.Config(layers_per_stage=(5, 6), num_microbatches=2),
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=nn.CrossEntropyLoss())
    model.build(x[:10])
    posted: list[tuple[torch.dtype, int]] = []
    _count_wire_sends(posted)
    steps = []
    for a in range(0, 30, 10):
        start = len(posted)
        model.train_on_batch(x[a:a + 10], y[a:a + 10])
        steps.append(posted[start:])
    return steps


@pytest.mark.timeout(120)
def test_a_pipeline_describes_its_activations_in_the_first_step_only():
    # Stage 0 sends each micro-batch's (5, 16) activation; stage 1 returns its gradient. Both
    # micro-batches have the same input shapes, but the last one's activations also carry the
    # step's sums (loss, then the flags of stage 0, stage 1 and the loss: 4 float64), and its
    # gradient brings their total back: two keys, each described once, in step 1; the riding
    # sums are packed with the tensor they ride on, never a message of their own.
    first, second = run_ranks(2, train_and_count, timeout=110)
    activation = (torch.float32, 5 * 16 * 4)
    carrying = (torch.uint8, 5 * 16 * 4 + 4 * 8)
    assert [dtype for dtype, _ in first[0][:3]] == DESCRIPTION, first[0]
    assert first[0][3] == activation, first[0]
    assert [dtype for dtype, _ in first[0][4:7]] == DESCRIPTION, first[0]
    assert first[0][7:] == [carrying], first[0]
    assert first[1] == first[2] == [activation, carrying], first  # raw tensors only from step 2 on
    assert second == [[activation, carrying]] * 3, second  # gradients: never described
