"""Tests for plait.cost.roofline: tile and wave quantization as NVIDIA's guide counts it, the
pipeline fill over K, the epilogue's store, memory-bound GEMMs and element-wise bytes, a measured
copy bandwidth and layer norm throughput, a block's times by tp."""

from __future__ import annotations

import pytest

from plait.cost.roofline import PIPELINE_K, Gpu, block_times, gemm_s, head_times, memory_s, norm_s, quantization

A100 = Gpu(312e12, 108, 2039e9)


def test_one_full_wave_of_large_tiles_is_all_useful() -> None:
    # 108 tiles of 256 x 128 fill the 108 SMs once
    assert quantization(256 * 12, 128 * 9, 1, 108) == 1.0
    m, n, k = 256 * 12, 128 * 9, 8192
    store = m * n * 2 / 2039e9  # the epilogue writes C once the K loop is done
    assert gemm_s(m, n, k, A100) == pytest.approx(2 * m * n * k / (312e12 * k / (k + PIPELINE_K)) + store)


def test_the_epilogue_store_adds_to_the_main_loop() -> None:
    # attention scores q k^T: a 2048 x 2048 output per head from K = 128 -- its store is a large
    # share of the time, where max(FLOPs, bytes) would hide it
    m, n, k, heads = 2048, 2048, 128, 32
    compute = 2 * m * n * k * heads / (312e12 * quantization(m, n, heads, 108) * k / (k + PIPELINE_K))
    store = m * n * heads * 2 / 2039e9
    assert store > 0.5 * compute
    assert gemm_s(m, n, k, A100, heads) == pytest.approx(compute + store)


def test_a_measured_copy_bandwidth_replaces_the_data_sheet() -> None:
    streamed = Gpu(312e12, 108, 2039e9, stream_bandwidth=1800e9)
    assert (A100.bandwidth, streamed.bandwidth) == (2039e9, 1800e9)
    assert memory_s(1800e9, streamed) == pytest.approx(1.0)
    m, n, k = 1, 8192, 8192  # memory-bound: every byte at the measured bandwidth
    assert gemm_s(m, n, k, streamed) == pytest.approx(gemm_s(m, n, k, A100) * 2039 / 1800)


def test_a_measured_layer_norm_replaces_its_bytes_at_the_bandwidth() -> None:
    # unmeasured: 2 bytes an element each way forward, twice that backward, at the bandwidth;
    # measured: the forward's input and output at its throughput, the backward's three tensors at its
    s, h = 2048, 6144
    values = s * h
    assert norm_s(values, A100) == pytest.approx((4 * values / 2039e9, 8 * values / 2039e9))
    normed = Gpu(312e12, 108, 2039e9, norm_bandwidth=(900e9, 600e9))
    forward, backward = norm_s(values, normed)
    assert (forward, backward) == pytest.approx((4 * values / 900e9, 6 * values / 600e9))
    # a block has two layer norms, the head one; nothing else moves
    plain, slow = block_times(s, h, 48, A100, 8), block_times(s, h, 48, normed, 8)
    assert slow.forward_s - plain.forward_s == pytest.approx(2 * (forward - 4 * values / 2039e9))
    assert slow.backward_s - plain.backward_s == pytest.approx(2 * (backward - 8 * values / 2039e9))
    assert slow.weight_s == plain.weight_s
    head_plain, head_slow = head_times(s, h, 51200, A100, 8), head_times(s, h, 51200, normed, 8)
    assert head_slow.forward_s - head_plain.forward_s == pytest.approx(forward - 4 * values / 2039e9)


def test_one_tile_more_than_a_wave_costs_a_second_wave() -> None:
    # 109 tiles of 256 x 128: a second wave for one tile (109 / 216 useful); 64 x 64 tiles make
    # 872 tiles in 9 waves of 108 (872 / 972), the best of cuBLAS's tiles here
    m, n = 256 * 109, 128
    assert quantization(m, n, 1, 108) == pytest.approx(872 / 972)
    assert quantization(m, n, 1, 109) == 1.0


def test_a_dimension_that_does_not_fill_its_tile_wastes_the_rest() -> None:
    # N = 65 in 64-wide tiles: two columns of tiles for 65 useful columns
    assert quantization(64 * 108, 65, 1, 108) < quantization(64 * 108, 64, 1, 108) == 1.0


def test_a_thin_gemm_is_bound_by_memory() -> None:
    # one row times a 8192 x 8192 weight: reading the weight takes longer than the FLOPs
    m, n, k = 1, 8192, 8192
    assert gemm_s(m, n, k, A100) == pytest.approx((m * k + k * n + m * n) * 2 / 2039e9)
    assert gemm_s(0, 10, 10, A100) == 0.0


def test_elementwise_bytes_at_bandwidth() -> None:
    assert memory_s(2039e9, A100) == pytest.approx(1.0)


def test_a_block_on_more_ranks_is_faster_but_less_than_linearly() -> None:
    one = block_times(2048, 4096, 32, A100)
    eight = block_times(2048, 4096, 32, A100, tp=8)
    total = lambda t: t.forward_s + t.backward_s + t.weight_s  # noqa: E731
    assert total(one) / 8 < total(eight) < total(one) / 4
    assert one.backward_s > one.forward_s > one.weight_s > 0  # B holds the attention's backward


def test_the_head_splits_its_vocabulary() -> None:
    one, two = head_times(1024, 1024, 51200, A100), head_times(1024, 1024, 51200, A100, tp=2)
    assert two.forward_s < one.forward_s and two.weight_s == pytest.approx(one.weight_s / 2, rel=0.05)


def test_a_measured_rate_replaces_the_peak_and_is_given_back_at_its_shape() -> None:
    measured = Gpu(312e12, 108, 2039e9, measured_flops=250e12, measured_shape=(256 * 12, 128 * 9, 8192))
    m, n, k = 256 * 12, 128 * 9, 8192
    assert 2 * m * n * k / gemm_s(m, n, k, measured) == pytest.approx(250e12)
    # one full wave (quantization 1): the main loop's time is the measured time less the epilogue's store
    main_loop = 2 * m * n * k / 250e12 - m * n * 2 / 2039e9
    assert measured.rate == pytest.approx(2 * m * n * k / main_loop * (k + PIPELINE_K) / k)
    # other shapes keep their own quantization at the measured rate
    store = 4100 * 4096 * 2 / 2039e9
    assert gemm_s(4100, 4096, 4096, measured) - store == pytest.approx(
        (gemm_s(4100, 4096, 4096, A100) - store) * 312e12 / measured.rate)
    # a measurement above what the shape terms allow never lifts the rate above the peak
    assert Gpu(312e12, 108, 2039e9, measured_flops=400e12, measured_shape=(4096, 4096, 4096)).rate == 312e12


def test_no_gemm_runs_faster_than_the_best_measured_rate() -> None:
    # the A100 preset's best matmul (271.2 TFLOP/s at 1024 x 10240 x 5120) is a scan's maximum;
    # the 1T row's QKV GEMM on tp=8 (2048 x 9600 x 25600) quantizes better than the measured shape,
    # and the shape terms alone would time it at ~282 TFLOP/s
    measured = Gpu(312e12, 108, 2039e9, measured_flops=271.2e12, measured_shape=(1024, 10240, 5120),
                   stream_bandwidth=1800e9)
    m, n, k = 2048, 9600, 25600
    uncapped = Gpu(measured.rate, 108, 2039e9, stream_bandwidth=1800e9)  # the same terms, no ceiling
    assert 2 * m * n * k / gemm_s(m, n, k, uncapped) > 280e12
    assert 2 * m * n * k / gemm_s(m, n, k, measured) == pytest.approx(271.2e12)
    for shape in [(8192, 8192, 8192), (4096, 12288, 6144), (2048, 25600, 12800), (256 * 12, 128 * 9, 8192)]:
        assert 2 * shape[0] * shape[1] * shape[2] / gemm_s(*shape, measured) <= 271.2e12 * (1 + 1e-12), shape
    # at the measured shape the measured rate comes back, below it the shape's own terms rule
    assert 2 * 1024 * 10240 * 5120 / gemm_s(1024, 10240, 5120, measured) == pytest.approx(271.2e12)
    assert gemm_s(1000, 1000, 100, measured) == gemm_s(1000, 1000, 100, uncapped)
