"""A pinned pool lives as long as something holds it: a load in progress, or the owner of
a backend that lives as long as the process. A plugin that makes a backend per load
leaves no page-locked memory behind it; a backend whose pool is kept reuses its
buffers from load to load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loaderplug.devices.pinned import pool_of, release_pinned_memory
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.testing.fake_device import FakeDevice, FakeDevicePlugin

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors.torch")
from loaderplug.tensors.reader import iter_tensors  # noqa: E402
from tests.helpers.tensors import STREAMED, reference, same  # noqa: E402

# 4 KiB spans through 16 KiB of pinned memory: each buffer is lent many times over.
SMALL = {**STREAMED, "bytes_in_flight": "16K"}
LOADS = 6


def still_pinned(device: FakeDevice) -> int:
    """How many buffers ``device`` pinned and has not unpinned."""
    return len(device.record_of.pinned) - device.record_of.unpinned


class BackendPerLoad:
    """A plugin that answers every load with a backend of its own."""

    def __init__(self) -> None:
        self.made: list[FakeDevice] = []

    @hookimpl
    def loaderplug_device_backend(self, device: str) -> FakeDevice | None:
        if not device.startswith("cuda"):
            return None
        self.made.append(FakeDevice(delay_s=0.0))
        return self.made[-1]


def test_a_backend_made_per_load_leaves_no_pinned_memory_behind(
    shards: list[Path], register_plugin: Any
) -> None:
    plugin = register_plugin(BackendPerLoad())
    expected = reference(shards)
    for load in range(1, LOADS + 1):
        got = dict(iter_tensors(shards, "cuda", **SMALL))
        assert all(same(got[name], tensor) for name, tensor in expected.items())
        assert len(plugin.made) == load
        assert all(device.record_of.pinned for device in plugin.made)  # each load pinned
        assert [still_pinned(device) for device in plugin.made] == [0] * load
        assert all(device.record_of.misuses == [] for device in plugin.made)


def test_a_backend_whose_pool_is_kept_reuses_its_buffers_from_load_to_load(
    shards: list[Path], register_plugin: Any
) -> None:
    device = FakeDevice(delay_s=0.0)
    register_plugin(FakeDevicePlugin(device))
    kept = pool_of(device)  # as the CUDA backend of each device keeps its own
    expected = reference(shards)
    dict(iter_tensors(shards, "cuda", **SMALL))
    pinned = list(device.record_of.pinned)
    assert pinned and still_pinned(device) == len(pinned)
    for _ in range(LOADS):
        got = dict(iter_tensors(shards, "cuda", **SMALL))
        assert all(same(got[name], tensor) for name, tensor in expected.items())
    assert device.record_of.pinned == pinned  # nothing pinned again
    assert kept.lent == 0
    release_pinned_memory()
    assert still_pinned(device) == 0
