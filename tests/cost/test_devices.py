"""Tests for plait.cost.devices: the presets' published numbers, sustained FLOP/s and usable memory,
lookup by name, and devices that cannot be."""

from __future__ import annotations

import pytest

from plait.cost.devices import DEVICES, GIB, Device, device
from plait.cost.network import Link, Network
from plait.errors import ConfigError

NET = Network(Link(0.0, 1.0), Link(0.0, 1.0), 1)


def test_presets() -> None:
    for name in ("v100-16gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "mi250x", "cpu"):
        dev = DEVICES[name]
        assert dev.flops < dev.peak_flops and dev.usable_memory() < dev.memory_bytes
        assert (dev.gpu is None) == (name == "cpu")
    assert device("V100-16GB").name == "v100-16gb"
    assert device("v100-16gb").network.inter.bandwidth == pytest.approx(25e9 / 8)  # Alpa: 25 Gbps
    with pytest.raises(ConfigError, match="presets: a100-40gb, a100-80gb"):
        device("tpu-v4")


def test_the_presets_and_their_numbers() -> None:
    assert sorted(DEVICES) == ["a100-40gb", "a100-80gb", "cpu", "h100-80gb", "h200-141gb", "mi250x", "v100-16gb"]
    assert all(DEVICES[name].name == name for name in DEVICES)
    v100 = device("v100-16gb")
    assert (v100.peak_flops, v100.sms, v100.memory_bytes, v100.dtype_bytes) == (125e12, 80, 16 * GIB, 2)
    assert v100.network.devices_per_node == 8 and v100.network.intra == Link(3.4e-6, 150e9, 8.4e-6, tree=True)  # 6 NVLink2 links x 25 GB/s
    a100 = device("a100-80gb")  # DGX A100: NVSwitch 300 GB/s each way, one 200 Gbit/s HDR per GPU
    assert (a100.peak_flops, a100.sms, a100.memory_bandwidth) == (312e12, 108, 2039e9)
    assert (a100.network.intra.bandwidth, a100.network.inter.bandwidth) == (300e9, 25e9)
    # GPUs: no efficiency factor; their sustained rate is the roofline's on a large square GEMM
    from plait.cost.roofline import gemm_s
    assert all(DEVICES[n].efficiency == 1.0 for n in DEVICES if DEVICES[n].sms)
    assert a100.flops == pytest.approx(2 * 8192**3 / gemm_s(8192, 8192, 8192, a100.gpu))
    # a measured best matmul (MAMF table) comes back from the roofline at the shape it was measured at
    for name, flops, shape in (("a100-80gb", 271.2e12, (1024, 10240, 5120)), ("h100-80gb", 794.5e12, (2048, 2048, 13312)),
                               ("mi250x", 147.0e12, (1024, 19968, 14080)), ("h200-141gb", 785.7e12, (8192, 8192, 8192)),
                               ("v100-16gb", 97.36e12, (8192, 8192, 8192))):
        dev = device(name)
        assert (dev.gemm_flops, dev.gemm_shape) == (flops, shape)
        m, n, k = shape
        assert 2 * m * n * k / gemm_s(m, n, k, dev.gpu) == pytest.approx(flops)
    assert v100.gpu.rate < v100.peak_flops  # the measured rate, over the roofline's own shape terms
    # a measured copy bandwidth where one was measured; the data sheet's elsewhere
    assert (a100.bandwidth, device("h200-141gb").bandwidth, v100.bandwidth) == (1800e9, 4170e9, 900e9)
    assert a100.gpu.bandwidth == 1800e9 and a100.memory_bandwidth == 2039e9
    # a layer norm kernel's measured throughput where one was measured (the H100 and H200); none elsewhere
    assert (device("h100-80gb").gpu.norm_bandwidth, device("h200-141gb").gpu.norm_bandwidth) == (
        (1.37e12, 0.74e12), (1.81e12, 1.06e12))
    assert a100.gpu.norm_bandwidth == v100.gpu.norm_bandwidth == (0.0, 0.0)
    cpu = device("cpu")
    assert (cpu.dtype_bytes, cpu.flops, cpu.network.intra) == (4, 50e9, Link(50e-6, 2e9))


def test_usable_memory_keeps_a_share_free() -> None:
    dev = device("a100-40gb")
    assert dev.usable_memory() == pytest.approx(0.9 * 40 * GIB)
    assert dev.usable_memory(0.5) == 20 * GIB


@pytest.mark.parametrize("changes, message", [
    ({"efficiency": 0.0}, "efficiency of test must be in (0, 1], got 0.0"),
    ({"efficiency": 1.5}, "efficiency of test must be in (0, 1], got 1.5"),
    ({"peak_flops": 0.0}, "device test: peak_flops, memory and bandwidth must be > 0"),
    ({"memory_bytes": -1.0}, "device test: peak_flops, memory and bandwidth must be > 0"),
    ({"memory_bandwidth": 0.0}, "device test: peak_flops, memory and bandwidth must be > 0"),
])
def test_a_device_that_cannot_be_is_named(changes: dict, message: str) -> None:
    fields = dict(name="test", peak_flops=1e12, efficiency=0.5, memory_bytes=GIB, memory_bandwidth=1e9,
                  network=NET, kernel_overhead_s=0.0)
    fields.update(changes)
    with pytest.raises(ConfigError) as info:
        Device(**fields)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_an_unknown_device_lists_the_presets() -> None:
    with pytest.raises(ConfigError) as info:
        device("rtx-4090")
    assert str(info.value) == ("unknown device 'rtx-4090'; presets: a100-40gb, a100-80gb, cpu, h100-80gb, h200-141gb, "
                               "mi250x, v100-16gb, or a FILE.json describing one (Device.to_dict)")


def test_a_device_described_in_a_file_is_the_device(tmp_path) -> None:
    # every preset round-trips through JSON; a file of one, edited, is that device with the edit
    import dataclasses
    import json
    for dev in DEVICES.values():
        assert Device.from_dict(json.loads(json.dumps(dev.to_dict()))) == dev
    data = device("a100-80gb").to_dict()
    data.update(name="my-a100", memory_bytes=40 * GIB)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    assert device(str(path)) == dataclasses.replace(device("a100-80gb"), name="my-a100", memory_bytes=40 * GIB)


@pytest.mark.parametrize("text, message", [
    (None, "device file '{path}' not found; write one from a preset"),
    ("{", "device file '{path}' is not JSON"),
    ("[1, 2]", "device file '{path}' holds list, not a device's object"),
    ('{"name": "x", "flops": 1}', "not a device description: unknown keys ['flops']; its keys are ['name', "),
    ('{"name": "x", "peak_flops": 1e12}', "device description 'x' is incomplete or malformed ('network')"),
])
def test_a_device_file_that_cannot_be_read_is_named(tmp_path, text, message) -> None:
    path = tmp_path / "dev.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        device(str(path))
    assert str(info.value).startswith(message.format(path=path))
