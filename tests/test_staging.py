"""Loads to a device through pinned buffers, on a stand-in device whose copies run late.

The stand-in (:mod:`loaderplug.testing.fake_device`) is registered for CUDA devices, so
``iter_tensors(paths, "cuda")`` takes the path it takes on a GPU. Its copies run on
threads of their own, each after a pause: a pinned buffer lent to another read before
its copy ran would be overwritten under it, and the stand-in records that (and a
buffer unpinned with a copy queued) as a misuse, besides the tensor coming out wrong.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loaderplug.devices.pinned import PinnedPool, pool_of
from loaderplug.errors import TransferFailed
from loaderplug.testing.fake_device import FakeDevice, FakeDevicePlugin, FakeEvent

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from loaderplug.tensors.format.read import read_header_of  # noqa: E402
from loaderplug.tensors.reader import iter_tensors  # noqa: E402
from tests.helpers.tensors import STREAMED, reference, same  # noqa: E402

# 4 KiB spans through 16 KiB of pinned memory: each buffer is lent many times over.
SMALL = {**STREAMED, "bytes_in_flight": "16K"}


@pytest.fixture
def device(register_plugin: Any) -> Iterator[FakeDevice]:
    """The stand-in for CUDA devices, its pinned pool kept for the test as the CUDA
    backend of a device keeps its own: loads reuse its buffers, and a test reads it."""
    fake = FakeDevice()
    register_plugin(FakeDevicePlugin(fake))
    pool = pool_of(fake)
    yield fake
    pool.clear()


def data_bytes(paths: list[Path]) -> int:
    return sum(h.size - h.data_start for h in map(read_header_of, paths))


def test_a_cuda_load_makes_no_host_copies(shards: list[Path], device: FakeDevice) -> None:
    load = iter_tensors(shards, "cuda", **SMALL)
    got = dict(load)
    expected = reference(shards)
    assert sorted(got) == sorted(expected)
    assert all(same(got[n], t) for n, t in expected.items())
    assert load.host_copied_bytes == 0
    assert load.device_copied_bytes == data_bytes(shards) == device.record_of.copied_bytes
    assert device.record_of.misuses == []
    assert pool_of(device).lent == 0


def test_each_tensor_has_device_memory_of_its_own(shards: list[Path], device: FakeDevice) -> None:
    """One allocation per tensor, of its size: a consumer that drops a tensor frees it,
    whatever it keeps of the same file."""
    got = dict(iter_tensors(shards, "cuda", **SMALL))
    sizes = sorted(n for n in device.record_of.allocations if n)
    assert sizes == sorted(t.numel() * t.element_size() for t in got.values() if t.numel())
    storages = {t.untyped_storage().data_ptr() for t in got.values() if t.numel()}
    assert len(storages) == len(sizes)


def test_pinned_buffers_are_made_once_and_reused_across_loads(
    shards: list[Path], device: FakeDevice
) -> None:
    dict(iter_tensors(shards, "cuda", **SMALL))
    made = len(device.record_of.pinned)
    assert 1 <= made <= 4  # 16 KiB of 4 KiB buffers
    again = dict(iter_tensors(shards, "cuda", **SMALL))
    assert len(device.record_of.pinned) == made and device.record_of.unpinned == 0
    assert all(same(again[n], t) for n, t in reference(shards).items())


def test_a_buffer_is_lent_again_only_after_its_copy_completed(
    shards: list[Path], register_plugin: Any
) -> None:
    """Copies slower than reads, two buffers: every buffer is lent again while readers
    wait for it, and never before its copies ran."""
    slow = FakeDevice(delay_s=0.003)
    register_plugin(FakeDevicePlugin(slow))
    got = dict(iter_tensors(shards, "cuda", **{**STREAMED, "bytes_in_flight": "8K"}))
    assert all(same(got[n], t) for n, t in reference(shards).items())
    assert len(slow.record_of.pinned) <= 2 < slow.record_of.copies
    assert slow.record_of.misuses == []


def test_the_pool_lends_a_buffer_only_once_its_event_completed() -> None:
    pool = PinnedPool(FakeDevice())
    never = threading.Event()
    first = pool.take(4096, 4096, never)
    blocker = FakeEvent()
    pool.give(first, blocker)
    taken: list[Any] = []
    taker = threading.Thread(target=lambda: taken.append(pool.take(4096, 4096, never)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not taken, "a buffer was lent before its copy completed"
    blocker._done.set()
    taker.join(5)
    assert taken and taken[0] is first and pool.made == 1


def test_the_pool_makes_room_for_a_larger_buffer_by_unpinning_free_ones() -> None:
    fake = FakeDevice()
    pool = PinnedPool(fake)
    never = threading.Event()
    small = [pool.take(64 * 1024, 128 * 1024, never) for _ in range(2)]
    for buffer in small:
        pool.give(buffer)
    # Larger than the budget: made once nothing else is pinned.
    big = pool.take(192 * 1024, 128 * 1024, never)
    assert big.capacity == 192 * 1024 and fake.record_of.unpinned == 2
    assert pool.pinned_bytes == 192 * 1024


def test_a_reader_waiting_for_a_buffer_stops_when_cancelled() -> None:
    from loaderplug.engine.retry import Cancelled

    pool = PinnedPool(FakeDevice())
    cancel = threading.Event()
    pool.take(4096, 4096, cancel)  # the only buffer the budget allows, never given back
    threading.Timer(0.1, cancel.set).start()
    with pytest.raises(Cancelled):
        pool.take(4096, 4096, cancel)


def test_every_buffer_comes_back_when_a_load_fails_half_way(
    shards: list[Path], device: FakeDevice, inject: Any
) -> None:
    inject(errno.EACCES, "model-1", at_offset=8192)
    load = iter_tensors(shards, "cuda", **SMALL)
    with pytest.raises(TransferFailed, match="model-1"):
        dict(load)
    assert pool_of(device).lent == 0
    assert device.record_of.misuses == []


def test_every_buffer_comes_back_when_the_consumer_stops_early(
    shards: list[Path], device: FakeDevice
) -> None:
    load = iter_tensors(shards, "cuda", **SMALL)
    next(load)
    load.close()
    assert pool_of(device).lent == 0
    assert device.record_of.misuses == []


def test_pinned_memory_stays_within_the_budget(tmp_path: Path, device: FakeDevice) -> None:
    from safetensors.torch import save_file

    paths = []
    for shard in range(6):
        path = tmp_path / f"big-{shard}.safetensors"
        save_file({f"b{shard}.{i}": torch.randn(64, 1024) for i in range(4)}, str(path))
        paths.append(path)
    budget = 256 * 1024
    settings = {**STREAMED, "span_bytes": "64K", "bytes_in_flight": budget}
    got = dict(iter_tensors(paths, "cuda", **settings))
    assert all(same(got[n], t) for n, t in reference(paths).items())
    assert pool_of(device).peak_bytes <= budget
    assert len(device.record_of.pinned) <= budget // (64 * 1024)  # the shorter reuse them


def test_a_one_pass_to_the_device_writes_the_copy_from_the_same_pinned_buffers(
    shards: list[Path], tmp_path: Path, device: FakeDevice
) -> None:
    local = tmp_path / "local"
    load = iter_tensors(shards, "cuda", local_dir=local, **SMALL)
    got = dict(load)
    assert all(same(got[n], t) for n, t in reference(shards).items())
    for f in shards:
        assert (local / f.name).read_bytes() == f.read_bytes()
    assert load.host_copied_bytes == 0 and device.record_of.misuses == []
    assert load.report is not None
    assert {r.status for r in load.report.results} == {"restored"}


def test_a_tensor_whose_offset_does_not_suit_its_dtype_gets_memory_of_its_own(
    tmp_path: Path, device: FakeDevice
) -> None:
    """safetensors does not require aligned offsets: a float32 three bytes into the
    data area cannot be a view of the file's allocation."""
    import json
    import struct

    values = torch.arange(4, dtype=torch.float32)
    header = {
        "odd": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "w": {"dtype": "F32", "shape": [4], "data_offsets": [3, 19]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "odd.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\x01\x02\x03" + values.numpy().tobytes())
    got = dict(iter_tensors([path], "cuda", **SMALL))
    assert same(got["w"], values)
    assert got["odd"].tolist() == [1, 2, 3]


def test_a_buffer_of_a_failed_file_is_lent_again_only_after_the_copies_from_it_ran(
    tmp_path: Path,
) -> None:
    """The file fails (abort) while a copy from a buffer is queued and the buffer's reader
    is still reading: the reader's "done" gives the buffer back fenced by its stream, so
    the next read waits for the copy before it lands there."""
    from safetensors.torch import save_file

    from loaderplug.tensors.device.path import DevicePath
    from loaderplug.tensors.device.sink import DeviceTensorSink

    path = tmp_path / "a.safetensors"
    save_file({"w": torch.arange(8192, dtype=torch.float32)}, str(path))
    header = read_header_of(path)
    slow = FakeDevice(delay_s=0.3)
    device = DevicePath("cuda:0", slow)
    sink = DeviceTensorSink(header, device, lambda name, tensor: None, limit=64 * 1024)
    sink.prepare()
    never = threading.Event()
    view = sink.place(0, header.size, never)
    view[: header.size] = path.read_bytes()
    writer = threading.Thread(target=sink.write, args=(view[:4096], 0))
    writer.start()  # its copy runs 0.3 s late
    time.sleep(0.05)
    aborter = threading.Thread(target=sink.abort)  # another reader failed the file
    aborter.start()
    time.sleep(0.05)
    del view
    sink.placed_read_done(0)  # this range's reader is done with its buffer
    again = device.take(header.size, 64 * 1024, never)  # the next read's buffer
    assert slow.record_of.copies == 1, "the buffer was lent before the copy from it ran"
    again.view[:4096] = b"\xff" * 4096
    writer.join(5)
    aborter.join(5)
    assert slow.record_of.misuses == []


def test_a_buffer_that_cannot_be_pinned_leaves_the_pool_as_it_was() -> None:
    class RefusesOnce(FakeDevice):
        refused = False

        def pin(self, memory: Any) -> Any:
            if not self.refused:
                self.refused = True
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            return super().pin(memory)

    pool = PinnedPool(RefusesOnce())
    never = threading.Event()
    with pytest.raises(OSError):
        pool.take(64 * 1024, 128 * 1024, never)
    assert (pool.pinned_bytes, pool.lent) == (0, 0)
    # The whole budget is there still: two buffers of half of it.
    assert [pool.take(64 * 1024, 128 * 1024, never).capacity for _ in range(2)] == [65536] * 2


def test_released_pinned_memory_is_unpinned_and_pinned_again_by_the_next_load(
    shards: list[Path], device: FakeDevice
) -> None:
    from loaderplug.devices.pinned import release_pinned_memory

    dict(iter_tensors(shards, "cuda", **SMALL))
    made = len(device.record_of.pinned)
    release_pinned_memory()
    assert device.record_of.unpinned == made and pool_of(device).pinned_bytes == 0
    got = dict(iter_tensors(shards, "cuda", **SMALL))
    assert all(same(got[n], t) for n, t in reference(shards).items())
