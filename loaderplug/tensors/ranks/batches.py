"""A streaming rank's own tensors, batched for its steps: every one landed by the time
it steps, or that none did yet."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from loaderplug.tensors.delivery.choice import TensorDelivery
from loaderplug.tensors.delivery.hand_over import (
    FileFinished,
    Idle,
    TensorReady,
    raise_if_failed,
)

# The most tensors a streaming rank offers in one step.
STREAM_BATCH = 64


class LandedBatches(Iterator["collections.deque[TensorReady] | Idle"]):
    """This rank's own tensors, for a stream's steps: every one landed by now (at least
    one, at most :data:`STREAM_BATCH`), or :class:`Idle` where none landed within the
    delivery's ``idle_after_s``. A step offers them all: a model of many small tensors
    takes a few steps, not one per tensor. Finished files are passed over (a failed
    one raises); past the first tensor only events already waiting are taken, so a
    finished file at the end of a batch never holds the step back."""

    def __init__(self, events: Iterator[Any], delivery: TensorDelivery) -> None:
        self._events = events
        self._delivery = delivery

    def __next__(self) -> collections.deque[TensorReady] | Idle:
        for event in self._events:
            if isinstance(event, Idle):
                return event
            if isinstance(event, FileFinished):
                raise_if_failed(event)
                continue
            return self._batch(event)
        raise StopIteration

    def _batch(self, first: TensorReady) -> collections.deque[TensorReady]:
        batch = collections.deque([first])
        while len(batch) < STREAM_BATCH and self._delivery.has_waiting():
            event = next(self._events, None)
            if isinstance(event, FileFinished):
                raise_if_failed(event)
            elif isinstance(event, TensorReady):
                batch.append(event)
            else:
                break  # the end (the next call says so); an Idle cannot wait here
        return batch
