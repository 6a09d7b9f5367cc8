"""A streaming rank's own tensors, batched for its steps: all that landed by the time it
steps (so a model of many small tensors takes a few steps, not one per tensor), or Idle
where none did (so the other ranks' tensors move on without it)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

from loaderplug.tensors.delivery import FileFinished, Idle, TensorReady
from loaderplug.tensors.ranks import STREAM_BATCH, LandedBatches
from loaderplug.types import FileResult


class _Delivery:
    """The delivery's queue of events, as the hand-over reads it: Idle when nothing
    arrives within a moment, the end at None."""

    def __init__(self) -> None:
        self.ready: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def has_waiting(self) -> bool:
        return not self.ready.empty()

    def events(self) -> Iterator[Any]:
        while True:
            try:
                event = self.ready.get(timeout=0.01)
            except queue.Empty:
                yield Idle()
                continue
            if event is None:
                return
            yield event


def _tensor(n: int) -> TensorReady:
    return TensorReady("a.safetensors", f"t{n}", n)


def test_every_tensor_landed_goes_in_one_batch_past_finished_files() -> None:
    delivery = _Delivery()
    for event in (_tensor(1), _tensor(2), FileFinished(FileResult("a", "copied")), _tensor(3)):
        delivery.ready.put(event)
    batches = LandedBatches(delivery.events(), delivery)  # type: ignore[arg-type]
    assert [t.name for t in next(batches)] == ["t1", "t2", "t3"]  # type: ignore[union-attr]
    assert isinstance(next(batches), Idle)  # nothing more landed yet
    delivery.ready.put(_tensor(4))
    delivery.ready.put(None)
    assert [t.name for t in next(batches)] == ["t4"]  # type: ignore[union-attr]
    assert next(batches, None) is None


def test_a_batch_is_bounded() -> None:
    delivery = _Delivery()
    for n in range(STREAM_BATCH + 5):
        delivery.ready.put(_tensor(n))
    delivery.ready.put(None)
    batches = LandedBatches(delivery.events(), delivery)  # type: ignore[arg-type]
    assert len(next(batches)) == STREAM_BATCH  # type: ignore[arg-type]
    assert len(next(batches)) == 5  # type: ignore[arg-type]
    assert next(batches, None) is None
