"""A load to a device holds a budget of device memory, not a file's worth.

Each tensor gets device memory of its own once its bytes start landing, and that memory
is freed the moment the consumer drops the tensor; the tensors not yet handed over stay
within LOADERPLUG_DEVICE_BYTES (unset: the bytes-in-flight budget). Run on the stand-in
device (:mod:`loaderplug.testing.fake_device`), which counts the device bytes that some
tensor still holds, and the most it ever held.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loaderplug.devices.pinned import pool_of
from loaderplug.testing.fake_device import FakeDevice, FakeDevicePlugin
from loaderplug.testing.model import write_shard
from loaderplug.units import MiB

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
from loaderplug.tensors.format.read import read_header_of  # noqa: E402
from loaderplug.tensors.reader import iter_tensors  # noqa: E402
from tests.helpers.tensors import reference, same  # noqa: E402

# 64 MiB of tensors of 1 to 4 MiB, and one of 12 MiB, larger than the budget.
PATTERN_MIB = [1, 2, 3, 4] * 2 + [12] + [1, 2, 3, 4] * 3 + [2]
LARGEST = 12 * MiB
BUDGET = 8 * MiB
# Spans of 1 MiB: no span begins two tensors, so what the budget may stretch to is known.
READS = {"span_bytes": "1M", "readers": 4, "direct_io": "off", "progress": False}


@pytest.fixture
def device(register_plugin: Any) -> Iterator[FakeDevice]:
    """The stand-in for CUDA devices, its pinned pool kept for the test as the CUDA
    backend of a device keeps its own: loads reuse its buffers, and a test reads it."""
    fake = FakeDevice(delay_s=0.0)
    register_plugin(FakeDevicePlugin(fake))
    pool = pool_of(fake)
    yield fake
    pool.clear()


@pytest.fixture
def big_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    write_shard(path, [n * MiB for n in PATTERN_MIB], first_tensor=0, seed=1)
    return path


def freed_soon(device: FakeDevice, frees: int, tries: int = 2000) -> bool:
    """Whether the device counts ``frees`` frees before long: the thread that handed a
    tensor over may still be leaving the call that did when its consumer drops it."""
    for _ in range(tries):
        if device.record_of.frees >= frees:
            return True
        time.sleep(0.001)
    return False


def data_bytes(path: Path) -> int:
    header = read_header_of(path)
    return header.size - header.data_start


@pytest.mark.parametrize(
    "budget",
    [{"bytes_in_flight": "8M"}, {"device_bytes": "8M"}],
    ids=["bytes-in-flight-rule", "device-bytes"],
)
def test_a_consumer_that_drops_each_tensor_holds_the_budget_and_one_tensor(
    big_file: Path, device: FakeDevice, budget: dict[str, str]
) -> None:
    expected = reference([big_file])
    load = iter_tensors([big_file], "cuda", **READS, **budget)
    while (item := next(load, None)) is not None:
        name, tensor = item
        assert same(tensor, expected.pop(name)), name
        frees = device.record_of.frees
        del item, tensor  # dropped before the next is asked for
        freed_soon(device, frees + 1, tries=200)  # the peak below says if it was not
    assert not expected
    peak = device.record_of.peak_allocated_bytes
    # The tensors not handed over (the budget, stretched for the 12 MiB tensor and the
    # one after it), and the consumer's one.
    assert peak <= BUDGET + LARGEST, f"{peak / MiB:.1f} MiB on the device at most"
    assert device.record_of.allocated_bytes == 0  # nothing of the load outlives its tensors
    assert device.record_of.misuses == [] and pool_of(device).lent == 0


def test_a_consumer_that_keeps_every_tensor_holds_the_model_once(
    big_file: Path, device: FakeDevice
) -> None:
    got = dict(iter_tensors([big_file], "cuda", device_bytes="8M", **READS))
    expected = reference([big_file])
    assert sorted(got) == sorted(expected)
    assert all(same(got[n], t) for n, t in expected.items())
    model = data_bytes(big_file)
    assert sum(device.record_of.allocations) == model  # each byte once: no copy of an arena
    assert device.record_of.peak_allocated_bytes <= model + BUDGET
    assert device.record_of.allocated_bytes == model  # what the consumer keeps
    del got
    assert device.record_of.allocated_bytes == 0


def test_a_load_stopped_early_frees_the_device_memory_of_tensors_not_handed_over(
    big_file: Path, device: FakeDevice
) -> None:
    load = iter_tensors([big_file], "cuda", device_bytes="8M", **READS)
    _, kept = next(load)
    load.close()
    assert device.record_of.allocated_bytes == kept.numel() * kept.element_size()
    assert device.record_of.misuses == [] and pool_of(device).lent == 0


def test_each_tensor_is_freed_as_soon_as_a_weight_loader_drops_it(
    tmp_path: Path, big_file: Path, device: FakeDevice
) -> None:
    """As vLLM's load with ``--load-format volcache`` on one worker: each weight is
    handed over on the device, copied into its parameter and dropped. Its memory goes
    back then, not when the rest of its file is dropped, so the load needs the
    parameters, the budget and the weight in hand."""
    from loaderplug.integrations import volcache
    from loaderplug.settings import from_env

    settings = from_env(device_bytes="8M", **READS)
    weights = volcache.locate_weights(str(big_file.parent), None, settings)
    header = read_header_of(big_file)
    params = {t.name: device.empty(t.nbytes) for t in header.tensors}  # the model's
    held_by_params = device.record_of.allocated_bytes
    for name, tensor in volcache.stream(weights, settings, device="cuda"):
        params[name].copy_(tensor.view(torch.uint8))  # vLLM's param.data.copy_(weight)
        frees = device.record_of.frees
        del tensor
        assert freed_soon(device, frees + 1), f"{name} outlived its consumer's hold"
    assert device.record_of.allocated_bytes == held_by_params
    peak = device.record_of.peak_allocated_bytes - held_by_params
    assert peak <= BUDGET + LARGEST, f"{peak / MiB:.1f} MiB on top of the parameters"
    expected = reference([big_file])
    assert all(same(params[n], t.view(torch.uint8)) for n, t in expected.items())


def test_a_span_set_larger_than_the_device_budget_is_cut_to_it(
    shards: list[Path], device: FakeDevice
) -> None:
    """Every span read is held on the device until its tensors are handed over: a span
    of 1 MiB within a 16 KiB device budget would take 64 budgets at once."""
    from loaderplug.engine.reading import READ_PADDING

    settings = {**READS, "split_threshold_bytes": 0}
    load = iter_tensors(shards, "cuda", **{**settings, "device_bytes": "16K"})
    got = dict(load)
    assert all(same(got[n], t) for n, t in reference(shards).items())
    assert load.bytes_in_flight == 16 * 1024  # what the load read at once, at most
    assert max(device.record_of.pinned) <= 16 * 1024 + READ_PADDING
