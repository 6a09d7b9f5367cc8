"""Device staging, driven by a backend whose copies run late on a thread of their own.

If the pool handed a pinned buffer out again before its copies had run, a later range
would overwrite bytes still waiting to be copied, and the tensors would come out wrong.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from loaderplug.tensors import staging
from loaderplug.tensors.staging import StagingPool

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from loaderplug.tensors.reader import iter_tensors  # noqa: E402
from tests.helpers.tensors import STREAMED, reference, same  # noqa: E402


class LateEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class LateBackend:
    """Copies run in order on one thread, each after a pause: a side stream, slowed."""

    def __init__(self) -> None:
        self.work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.pinned_made = 0
        self.copies = 0
        threading.Thread(target=self._stream, daemon=True).start()

    def _stream(self) -> None:
        while True:
            item = self.work.get()
            if isinstance(item, LateEvent):
                item._done.set()
                continue
            dst, src = item
            time.sleep(0.0005)
            dst.copy_(src)

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)

    def pinned(self, nbytes: int) -> torch.Tensor:
        self.pinned_made += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies += 1
        self.work.put((dst, src))

    def record(self) -> LateEvent:
        event = LateEvent()
        self.work.put(event)
        return event


@pytest.fixture
def late(monkeypatch: pytest.MonkeyPatch) -> LateBackend:
    backend = LateBackend()
    monkeypatch.setattr(
        "loaderplug.tensors.delivery.backend_for", lambda d: backend if d == "late" else None
    )
    # Two 4 KiB staging buffers for the whole job: each is reused many times over.
    monkeypatch.setattr(staging, "STAGING_BUFFER_BYTES", 4096)
    return backend


def test_tensors_reach_the_device_whole_through_reused_staging_buffers(
    shards: list[Path], late: LateBackend
) -> None:
    got = dict(iter_tensors(shards, "late", **{**STREAMED, "bytes_in_flight": "8K"}))
    expected = reference(shards)
    assert sorted(got) == sorted(expected)
    assert all(same(got[n], t) for n, t in expected.items())
    assert late.pinned_made == 2  # the pool never grew past bytes in flight
    assert late.copies > 50


def test_a_write_larger_than_a_staging_buffer_is_staged_in_pieces(
    shards: list[Path], late: LateBackend
) -> None:
    # 64 KiB ranges through 4 KiB staging buffers.
    settings = {**STREAMED, "span_bytes": "64K", "bytes_in_flight": "128K"}
    got = dict(iter_tensors(shards, "late", **settings))
    assert all(same(got[n], t) for n, t in reference(shards).items())
    assert late.pinned_made <= 32


def test_the_pool_waits_for_a_buffers_event_before_handing_it_out() -> None:
    backend = LateBackend()
    pool = StagingPool(backend, 16, 1)
    first = pool.take()
    blocker = LateEvent()
    pool.give(first, blocker)
    taken: list[torch.Tensor] = []
    taker = threading.Thread(target=lambda: taken.append(pool.take()))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive() and not taken, "a buffer was reused before its copy completed"
    blocker._done.set()
    taker.join(5)
    assert taken and taken[0] is first
    assert backend.pinned_made == 1


class StreamEvent:
    """An event on :class:`InOrderBackend`'s queue: waiting runs the queue up to it."""

    def __init__(self, backend: InOrderBackend) -> None:
        self.backend = backend

    def query(self) -> bool:
        return self not in self.backend.queue

    def synchronize(self) -> None:
        with self.backend.lock:
            while self in self.backend.queue:
                item = self.backend.queue.pop(0)
                if not isinstance(item, StreamEvent):
                    item[0].copy_(item[1])


class InOrderBackend:
    """A stream that runs nothing until an event is waited on; the thread named "B" is
    paused right after it records an event, until ``a_done`` is set."""

    def __init__(self) -> None:
        self.queue: list[Any] = []
        self.lock = threading.RLock()
        self.a_done = threading.Event()
        self.b_recorded = threading.Event()

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(nbytes, dtype=torch.uint8)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.lock:
            self.queue.append((dst, src.clone()))  # the staged bytes as they are now

    def record(self) -> StreamEvent:
        event = StreamEvent(self)
        with self.lock:
            self.queue.append(event)
        if threading.current_thread().name == "B" and not self.b_recorded.is_set():
            self.b_recorded.set()
            self.a_done.wait(5)
        return event


def test_a_tensor_finished_by_one_writer_waits_for_another_writers_copies() -> None:
    from loaderplug.tensors.header import Header, TensorInfo
    from loaderplug.tensors.sinks import DeviceTensorSink

    tensor = TensorInfo("w", "U8", (8,), 8, 16)
    header = Header("f", 16, 8, (tensor,), {})
    backend = InOrderBackend()
    got: dict[str, list[int]] = {}
    sink = DeviceTensorSink(
        header, StagingPool(backend, 4, 4), lambda n, t: got.setdefault(n, t.tolist())
    )
    sink.prepare()
    data = memoryview(bytes(range(16)))
    # B queues the tail and is paused; A queues the head; B then finishes the tensor.
    b = threading.Thread(target=lambda: sink.write(data[12:16], 12), name="B")
    b.start()
    assert backend.b_recorded.wait(5)
    sink.write(data[8:12], 8)
    backend.a_done.set()
    b.join(5)
    assert got == {"w": list(range(8, 16))}


@pytest.mark.parametrize("source", ["writable", "read-only", "empty"])
def test_staging_fills_the_start_of_a_buffer_with_the_bytes_given(source: str) -> None:
    from loaderplug.tensors.staging import fill

    payload = bytes(range(256)) * 64 if source != "empty" else b""
    data = memoryview(bytearray(payload) if source == "writable" else payload)
    buffer = torch.full((len(payload) + 100,), 0xAB, dtype=torch.uint8)
    fill(buffer, data)
    assert bytes(buffer[: len(payload)].numpy()) == payload
    assert buffer[len(payload) :].eq(0xAB).all()  # nothing past the data touched
