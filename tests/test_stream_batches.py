"""A streaming rank's own tensors, batched for its steps: all that landed by the time it
steps (so a model of many small tensors takes a few steps, not one per tensor), or Idle
where none did (so the other ranks' tensors move on without it)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import Any

import pytest

from loaderplug.errors import LoaderplugError
from loaderplug.tensors.delivery.hand_over import FileFinished, Idle, TensorReady
from loaderplug.tensors.ranks.batches import STREAM_BATCH, LandedBatches
from loaderplug.types import FileResult


class _Delivery:
    """The delivery's queue of events, as the hand-over reads it: Idle when nothing
    arrives within a moment, the end at None."""

    def __init__(self) -> None:
        self.ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.waits = 0  # how many times the consumer waited for an event to arrive

    def has_waiting(self) -> bool:
        return not self.ready.empty()

    def events(self) -> Iterator[Any]:
        while True:
            self.waits += self.ready.empty()
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


def test_a_finished_file_at_the_end_of_a_batch_does_not_hold_the_step_back() -> None:
    """Past the first tensor a batch takes only events already waiting: with a file
    finished last, the batch is handed to the step without waiting for what lands next
    (an idle period, at a moment when every other rank may be waiting in the step)."""
    delivery = _Delivery()
    for event in (_tensor(1), FileFinished(FileResult("a", "copied"))):
        delivery.ready.put(event)
    batches = LandedBatches(delivery.events(), delivery)  # type: ignore[arg-type]
    assert [t.name for t in next(batches)] == ["t1"]  # type: ignore[union-attr]
    assert delivery.waits == 0


def test_a_failed_file_raises_even_inside_a_batch() -> None:
    delivery = _Delivery()
    failed = FileResult("b", "failed", reason="source changed while reading")
    for event in (_tensor(1), FileFinished(failed), _tensor(2)):
        delivery.ready.put(event)
    batches = LandedBatches(delivery.events(), delivery)  # type: ignore[arg-type]
    with pytest.raises(LoaderplugError, match="source changed while reading"):
        next(batches)
