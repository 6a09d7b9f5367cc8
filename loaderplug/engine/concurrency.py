"""How many readers may read at once: a fixed count, or one that follows the storage.

The engine starts as many reader threads as the bytes-in-flight budget allows, and each
takes a :class:`Slot` from a limit before it reads a range. :class:`FixedLimit` lets
``workers`` in. :class:`AdaptiveLimit` (``LOADERPLUG_READERS=auto``) moves its
limit while the copy runs:

* **Grow** while throughput rises: every window (a quarter second or more, begun after
  the time the readers a step added need for their first read, as the last window's
  reads took, at most ``MAX_SETTLE_S``) compares the bytes read per
  second with the last window's, at the last limit. A gain of at least
  ``GAIN`` doubles the limit at first (a slow start, as TCP's: a model of a few GiB is
  copied in seconds, too few windows to climb from 16 to 32 by small steps) and raises
  it by a quarter once a step has failed to gain; a smaller gain goes back one step and
  holds there: fewer readers for the same bytes load the storage less. A network volume
  with a per-stream cap keeps gaining until its aggregate cap. A doubling is safe on
  the throughput side: on a curve that flattens, a doubling that gains less than
  ``GAIN`` means the level below it already had nearly all there is.
* **Back off** on a transient error (ENOMEM, EAGAIN, EIO): the limit drops at once to
  the reads that were still going when one failed (what the storage took), by at most
  half, and the level that failed is out of reach for the next ``CAP_HOLD_S``; from
  there it climbs one reader per window. Retries wait for a slot under the new limit.
  An object-store mount that answers more than K reads in flight with ENOMEM settles
  at K. One burst counts once: errors of reads that began before the last drop are the
  storm that drop answered, and only take the limit on down to the reads still going
  (the first error saw reads going that failed a moment later), no lower than half.
* **Back off** on rising latency: while holding, two windows in a row whose read latency
  grew by ``LATENCY_RISE`` without more throughput mean the storage queues the same
  bytes for longer (another tenant, a busier host); the limit drops by a quarter and
  climbs again.
* **Re-probe** while holding, every ``PROBE_EVERY`` windows, one step up, so a volume
  that got faster is noticed.

A window counts only when every permitted reader had work; the last ranges of a job,
when readers run out of spans, say nothing about the storage. The limit never exceeds
``ceiling``, the readers the bytes-in-flight budget allows.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from loaderplug.engine.retry import Cancelled
from loaderplug.settings import AUTO_START_WORKERS

WINDOW_S = 0.25  # shortest measuring window
SETTLE_S = 0.1  # after a change, time for new readers to reach speed before measuring
MAX_SETTLE_S = 1.0  # ... but no longer, however slow a read was: the job goes on
GAIN = 0.05  # a step up must raise throughput this much to count as a gain
LATENCY_RISE = 1.5  # latency grown this much, with no more throughput: back off
CAP_HOLD_S = 10.0  # how long a level that failed stays out of reach
PROBE_EVERY = 8  # windows held between two probes one step up

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Slot:
    """One reader's permission to read; ``drops`` counts the limit's drops before it."""

    drops: int
    limit: ConcurrencyLimit
    held: bool = True
    backing_off: bool = False  # between a transient error and its retry

    def read_done(self, nbytes: int, seconds: float) -> None:
        """``nbytes`` arrived from the storage in one read that took ``seconds``."""
        self.limit.read_done(nbytes, seconds)

    def transient_error(self) -> None:
        self.limit.transient_error(self)

    def renew(self, cancel: threading.Event) -> None:
        """Before a retry: wait here if the limit dropped below the readers holding
        slots, so a retry does not add to the overload its error reported."""
        self.limit.renew(self, cancel)


class ConcurrencyLimit:
    """A counting gate with a limit; subclasses decide how the limit moves."""

    adaptive = False  # whether the limit moves on its own as reads report back

    def __init__(self, limit: int, ceiling: int) -> None:
        self.ceiling = max(1, ceiling)
        self.limit = max(1, min(limit, self.ceiling))
        self.lowest = self.highest = self.limit
        self.drops = 0
        self._active = 0  # slots held
        self._backing_off = 0  # slots held by readers waiting to retry
        self._readers = 0
        self._cond = threading.Condition()

    def enter(self) -> None:
        """A reader starts: it may ask for slots until it calls :meth:`leave`."""
        with self._cond:
            self._readers += 1

    def leave(self) -> None:
        with self._cond:
            self._readers -= 1

    def acquire(self, cancel: threading.Event) -> Slot:
        with self._cond:
            self._wait_below_limit(cancel)
            self._active += 1
            return Slot(self.drops, self)

    def release(self, slot: Slot) -> None:
        with self._cond:
            self._let_go(slot)

    def transient_error(self, slot: Slot) -> None:
        with self._cond:
            if not slot.backing_off:
                slot.backing_off = True
                self._backing_off += 1
            self._overloaded(slot)

    def renew(self, slot: Slot, cancel: threading.Event) -> None:
        with self._cond:
            if self._active > self.limit:
                self._let_go(slot)
                self._wait_below_limit(cancel)
                self._active += 1
                slot.held = True
            elif slot.backing_off:
                slot.backing_off = False
                self._backing_off -= 1
            slot.drops = self.drops

    def read_done(self, nbytes: int, seconds: float) -> None:
        """Fixed limits do not measure."""

    def _overloaded(self, slot: Slot) -> None:
        """A read of ``slot`` failed transiently (lock held). Fixed limits do not react;
        the engine's per-range retry does."""

    def _let_go(self, slot: Slot) -> None:
        if slot.held:
            slot.held = False
            self._active -= 1
            self._cond.notify()
        if slot.backing_off:
            slot.backing_off = False
            self._backing_off -= 1

    def _wait_below_limit(self, cancel: threading.Event) -> None:
        while self._active >= self.limit:
            if cancel.is_set():
                raise Cancelled
            self._cond.wait(0.05)

    def _set(self, limit: int) -> None:
        """Move the limit (lock held)."""
        limit = max(1, min(limit, self.ceiling))
        if limit != self.limit:
            log.debug("concurrency limit %d -> %d", self.limit, limit)
            self.limit = limit
            self.lowest, self.highest = min(self.lowest, limit), max(self.highest, limit)
            self._cond.notify_all()


class FixedLimit(ConcurrencyLimit):
    """``workers`` readers at once, always."""

    def __init__(self, workers: int) -> None:
        super().__init__(workers, workers)


@dataclass
class _Window:
    started: float
    bytes: int = 0
    read_seconds: float = 0.0
    reads: int = 0
    full: bool = True  # every permitted reader had work the whole window

    @property
    def latency(self) -> float:
        """Seconds per byte of one read: rises when the storage queues requests."""
        return self.read_seconds / self.bytes if self.bytes else 0.0


class AdaptiveLimit(ConcurrencyLimit):
    """A limit that climbs while throughput rises and drops on errors or queueing."""

    adaptive = True

    def __init__(
        self,
        ceiling: int,
        start: int = AUTO_START_WORKERS,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(start, ceiling)
        self._clock = clock
        self._window = _Window(clock() + SETTLE_S)
        self._previous: tuple[int, float] | None = None  # (limit, rate) of the last window
        self._read_s = 0.0  # how long one read took in the last window
        self._doubling = True  # until a step fails to gain or the storage pushes back
        self._additive = False  # after a drop, climb one reader at a time
        self._hold: _Hold | None = None
        self._cap, self._cap_until = self.ceiling, 0.0
        self._storm_floor = 1  # the lowest the storm of the last drop may take the limit

    # -- signals from readers ------------------------------------------------------

    def read_done(self, nbytes: int, seconds: float) -> None:
        with self._cond:
            now = self._clock()
            window = self._window
            if now < window.started:  # still settling after a change
                return
            window.bytes += nbytes
            window.read_seconds += seconds
            window.reads += 1
            window.full = window.full and self._readers >= self.limit
            if now - window.started >= WINDOW_S and window.reads >= self.limit:
                self._window = _Window(now)
                self._read_s = window.read_seconds / window.reads
                if window.full:
                    self._decide(now, window.bytes / (now - window.started), window.latency)

    def _overloaded(self, slot: Slot) -> None:
        now = self._clock()
        # The reads still going when this one failed are what the storage took.
        still_reading = self._active - self._backing_off
        if slot.drops != self.drops:
            # A read from before the last drop: the storm that drop answered. Its first
            # error saw reads still going that failed a moment later; follow the storm
            # down to the reads that are left, no lower than the drop allowed.
            target = max(self._storm_floor, still_reading)
            if target < self.limit:
                self._move(now, target)
            return
        self._cap, self._cap_until = max(1, self.limit - 1), now + CAP_HOLD_S
        # Down to the reads still going (the storage refused one more), but never below
        # half at once.
        self._storm_floor = self.limit // 2
        self._drop(now, max(self._storm_floor, min(self.limit - 1, still_reading)))

    # -- decisions (lock held) -----------------------------------------------------

    def _decide(self, now: float, rate: float, latency: float) -> None:
        if now >= self._cap_until:
            self._cap = self.ceiling
        if self._hold is not None:
            self._holding(now, self._hold, rate, latency)
            return
        previous, self._previous = self._previous, (self.limit, rate)
        if previous is None or previous[0] >= self.limit or rate >= previous[1] * (1 + GAIN):
            self._climb(now, rate)
        else:  # the step up gained nothing worth its load: back to where it was
            self._start_hold(now, *previous)

    def _holding(self, now: float, hold: _Hold, rate: float, latency: float) -> None:
        if hold.probe_from is not None:
            # The window after a probe one step up keeps the step only if it gained.
            if rate >= hold.probe_from[1] * (1 + GAIN):
                self._hold, self._previous = None, (self.limit, rate)
                self._climb(now, rate)
            else:
                self._start_hold(now, *hold.probe_from)
            return
        if not hold.latency:
            hold.latency, hold.rate = latency, max(hold.rate, rate)
            return
        if latency > hold.latency * LATENCY_RISE and rate < hold.rate * (1 + GAIN):
            hold.rising += 1  # one slow window is noise (a writeback burst); two a trend
            if hold.rising >= 2:
                self._drop(now, self.limit - max(1, self.limit // 4))
            return
        hold.rising = 0
        hold.windows += 1
        if hold.windows >= PROBE_EVERY and self.limit < self._cap:
            hold.probe_from = (self.limit, rate)
            self._move(now, self.limit + 1)

    def _start_hold(self, now: float, limit: int, rate: float) -> None:
        self._hold, self._doubling = _Hold(rate), False
        self._move(now, limit)

    def _climb(self, now: float, rate: float) -> None:
        target = min(self.limit + self._step_up(), self._cap)
        if target <= self.limit:
            self._start_hold(now, self.limit, rate)
        else:
            self._move(now, target)

    def _step_up(self) -> int:
        if self._additive:
            return 1
        return self.limit if self._doubling else max(1, self.limit // 4)

    def _drop(self, now: float, limit: int) -> None:
        """Down to ``limit``, then climb again from there, one reader at a time."""
        self._hold, self._previous = None, None
        self._doubling, self._additive = False, True
        self.drops += 1
        self._move(now, limit)

    def _move(self, now: float, limit: int) -> None:
        # Bytes count when a read is done, so the first window after a step up must wait
        # for the new readers' first reads, which take longer now that more share the
        # storage: measured sooner, the step shows the old readers slowing down and not
        # yet what the new ones bring, and looks like no gain.
        settle = SETTLE_S
        if limit > self.limit:
            settle = max(settle, min(MAX_SETTLE_S, self._read_s * limit / self.limit))
        self._set(limit)
        self._window = _Window(now + settle)


@dataclass
class _Hold:
    """Holding at a limit: the rate and latency it was reached with, and a probe's origin."""

    rate: float
    latency: float = 0.0
    windows: int = 0
    rising: int = 0  # windows in a row with latency up and throughput not
    probe_from: tuple[int, float] | None = None
