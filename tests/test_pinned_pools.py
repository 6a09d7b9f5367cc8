"""A pinned pool lives as long as something holds it: a load in progress, or the owner of
a backend that lives as long as the process. A plugin that makes a backend per load
leaves no page-locked memory behind it; a backend whose pool is kept reuses its
buffers from load to load."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from loaderplug.devices.pinned import pool_of, release_pinned_memory
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.testing.fake_device import FakeDevice, FakeDevicePlugin

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors.torch")
from loaderplug.tensors.device.path import DevicePath  # noqa: E402
from loaderplug.tensors.device.sink import DeviceTensorSink  # noqa: E402
from loaderplug.tensors.format.read import read_header_of  # noqa: E402
from loaderplug.tensors.reader import iter_tensors  # noqa: E402
from tests.helpers.tensors import STREAMED, reference, same  # noqa: E402

# 4 KiB spans through 16 KiB of pinned memory: each buffer is lent many times over.
SMALL = {**STREAMED, "bytes_in_flight": "16K"}
LOADS = 6
# Bytes in flight of one 4 KiB buffer: a load that finds it lent for good waits forever.
LONE = {**STREAMED, "bytes_in_flight": "4K"}


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


def a_reader_left_behind(shard: Path, device: FakeDevice) -> DeviceTensorSink:
    """A file's sink whose reader still holds its pinned buffer (4 KiB) when the load
    ends: a second Ctrl-C stopped the load waiting for its readers, so the file was
    aborted and the load let go of its pool with the buffer still lent."""
    path = DevicePath("cuda:0", device)
    sink = DeviceTensorSink(read_header_of(shard), path, lambda name, tensor: None, 4096)
    sink.prepare()
    sink.place(0, 4096, threading.Event())
    sink.abort()  # the file unfinished: its reader's buffer stays lent
    path.release()  # the load is over
    return sink


def test_a_buffer_given_back_after_the_load_let_go_of_its_pool_is_the_pools_again(
    shards: list[Path], register_plugin: Any
) -> None:
    device = FakeDevice(delay_s=0.0)
    register_plugin(FakeDevicePlugin(device))
    kept = pool_of(device)
    sink = a_reader_left_behind(shards[0], device)
    assert kept.lent == 1
    sink.placed_read_done(0)  # the reader, done at last, gives its buffer back
    assert kept.lent == 0
    # A later load whose bytes in flight are that one buffer's gets it, not a full pool.
    later: list[dict[str, Any]] = []
    loader = threading.Thread(
        target=lambda: later.append(dict(iter_tensors(shards, "cuda", **LONE))), daemon=True
    )
    loader.start()
    loader.join(60)  # a guard against a hang, not a measure: a blocked load never ends
    assert later, "the later load is still waiting for pinned memory"
    expected = reference(shards)
    assert all(same(later[0][name], tensor) for name, tensor in expected.items())
    assert kept.lent == 0 and device.record_of.misuses == []


def test_a_buffer_given_back_after_its_pool_was_let_go_of_is_unpinned(
    shards: list[Path],
) -> None:
    device = FakeDevice(delay_s=0.0)  # a backend made for one load: nothing keeps its pool
    sink = a_reader_left_behind(shards[0], device)
    assert still_pinned(device) == 1
    sink.placed_read_done(0)
    assert still_pinned(device) == 0
    assert device.record_of.misuses == []
