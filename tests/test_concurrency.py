"""The adaptive limit, driven by simulated storage on a simulated clock.

Each tick, every slot the limit allows reads for ``TICK`` seconds of simulated time from a
storage with a per-stream cap, an aggregate cap and, optionally, ENOMEM for every read
past K in flight. The engine on the real FUSE volume is tested in test_hydrate_fuse.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from loaderplug.engine.concurrency import AdaptiveLimit, FixedLimit
from loaderplug.engine.retry import Cancelled
from loaderplug.settings import AUTO_START_WORKERS
from loaderplug.units import MiB

TICK = 0.01


@dataclass
class Storage:
    per_stream: float = 40 * MiB
    aggregate: float = 640 * MiB
    enomem_over: int | None = None
    queueing_s: float = 0.0  # extra service time per read, as on a host another tenant loads

    def throughput(self, readers: int) -> float:
        ok = min(readers, self.enomem_over or readers)
        return min(ok * self.per_stream, self.aggregate)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(limit: AdaptiveLimit, clock: Clock, storage: Storage, seconds: float) -> list[int]:
    """Simulate ``seconds`` of copying; the limit after every tick."""
    seen = []
    never = threading.Event()
    for _ in range(round(seconds / TICK)):
        slots = [limit.acquire(never) for _ in range(limit.limit)]
        rate = storage.throughput(len(slots))
        ok = min(len(slots), storage.enomem_over or len(slots))
        clock.now += TICK
        for slot in slots[ok:]:  # the reads past K in flight fail
            slot.transient_error()
        for slot in slots[:ok]:
            nbytes = int(rate * TICK / ok)
            slot.read_done(nbytes, TICK * len(slots) / ok + storage.queueing_s)
        for slot in slots:
            limit.release(slot)
        seen.append(limit.limit)
    return seen


def started(ceiling: int, start: int = AUTO_START_WORKERS) -> tuple[AdaptiveLimit, Clock]:
    clock = Clock()
    limit = AdaptiveLimit(ceiling, start, clock=clock)
    for _ in range(ceiling):
        limit.enter()
    return limit, clock


def settled(seen: list[int]) -> list[int]:
    """The limits of the last two seconds."""
    return seen[-round(2 / TICK) :]


def test_climbs_on_a_per_stream_capped_volume_until_the_aggregate_cap() -> None:
    storage = Storage(per_stream=40 * MiB, aggregate=640 * MiB)
    limit, clock = started(ceiling=32)
    last = settled(run(limit, clock, storage, 8))
    best = storage.throughput(32)
    # Within 90% of the best rate, without running to the ceiling for nothing.
    assert min(storage.throughput(n) for n in last) >= 0.9 * best
    assert max(last) <= 20 and limit.drops == 0


def test_doubles_at_first_so_a_short_job_reaches_many_readers_soon() -> None:
    storage = Storage(per_stream=40 * MiB, aggregate=1280 * MiB)
    limit, clock = started(ceiling=32)
    seen = run(limit, clock, storage, 1.5)
    assert sorted(set(seen)) == [16, 32] and seen[-1] == 32


def test_settles_under_the_in_flight_count_that_draws_enomem() -> None:
    storage = Storage(per_stream=40 * MiB, aggregate=640 * MiB, enomem_over=6)
    limit, clock = started(ceiling=32)
    seen = run(limit, clock, storage, 10)
    assert limit.drops >= 1 and limit.lowest <= 6
    # The first storm (ten of sixteen reads fail) halves the limit at once, not one
    # reader per error.
    assert seen[0] == AUTO_START_WORKERS // 2
    # Errors keep a level out of reach for a while: most of the time no read fails.
    assert sum(n <= 6 for n in settled(seen)) >= 0.9 * len(settled(seen))
    assert min(settled(seen)) >= 4  # backing off does not collapse to one reader


def test_a_storm_of_errors_drops_the_limit_once() -> None:
    limit, _clock = started(ceiling=32, start=16)
    never = threading.Event()
    slots = [limit.acquire(never) for _ in range(16)]
    for slot in slots:
        slot.transient_error()
    # Down to the fifteen reads still going when the first one failed; the other
    # fifteen errors are the same storm: they take the limit on down with them, but
    # no lower than half, and count as one drop.
    assert (limit.limit, limit.drops) == (8, 1)
    # A read that began after the drop fails while nothing else reads: that is news,
    # and the limit drops again, by at most half at once.
    for slot in slots:
        limit.release(slot)
    limit.acquire(never).transient_error()
    assert (limit.limit, limit.drops) == (4, 2)


def test_a_storm_that_stops_short_leaves_the_limit_at_the_reads_it_spared() -> None:
    limit, _clock = started(ceiling=32, start=16)
    never = threading.Event()
    slots = [limit.acquire(never) for _ in range(16)]
    for slot in slots[:5]:  # eleven reads go on: the storage takes eleven
        slot.transient_error()
    assert (limit.limit, limit.drops) == (11, 1)


def test_a_retry_waits_under_a_limit_that_dropped_since_its_error() -> None:
    limit, _clock = started(ceiling=32, start=4)
    never = threading.Event()
    slots = [limit.acquire(never) for _ in range(4)]
    slots[0].transient_error()  # three others still reading: the limit drops to them
    assert limit.limit == 3
    retried = threading.Thread(target=slots[0].renew, args=(never,))
    retried.start()
    retried.join(0.3)
    assert retried.is_alive()  # four slots held, three allowed: the retry waits
    limit.release(slots[1])
    retried.join(5)
    assert not retried.is_alive() and slots[0].held


def test_stays_low_when_more_readers_do_not_help() -> None:
    """Local disk: one reader already reaches what the device gives, so auto does not
    climb past where it started (and does not go below it unless the storage pushes)."""
    storage = Storage(per_stream=2000 * MiB, aggregate=2000 * MiB)
    limit, clock = started(ceiling=32)
    last = settled(run(limit, clock, storage, 6))
    assert max(last) <= AUTO_START_WORKERS + 1  # and a probe one above now and then


def test_backs_off_when_latency_rises_without_more_throughput() -> None:
    storage = Storage(per_stream=40 * MiB, aggregate=320 * MiB)
    limit, clock = started(ceiling=32)
    before = settled(run(limit, clock, storage, 4))
    # Another tenant: each read now waits longer, and the volume gives less in total.
    storage.queueing_s, storage.aggregate = 0.05, 200 * MiB
    after = settled(run(limit, clock, storage, 4))
    assert min(after) < min(before)


def test_never_exceeds_the_ceiling() -> None:
    storage = Storage(per_stream=40 * MiB, aggregate=100_000 * MiB)
    limit, clock = started(ceiling=12)
    assert max(run(limit, clock, storage, 6)) == 12


def test_a_window_with_idle_readers_decides_nothing() -> None:
    """The job's last ranges: fewer readers have work than the limit allows."""
    storage = Storage(per_stream=40 * MiB, aggregate=640 * MiB)
    limit, clock = started(ceiling=32)
    for _ in range(32 - 4):
        limit.leave()
    assert set(run(limit, clock, storage, 3)) == {AUTO_START_WORKERS}


def test_fixed_limit_lets_workers_in_and_stops_on_cancel() -> None:
    fixed, cancel = FixedLimit(2), threading.Event()
    fixed.acquire(cancel), fixed.acquire(cancel)
    cancel.set()
    with pytest.raises(Cancelled):
        fixed.acquire(cancel)


def test_a_step_up_is_judged_after_the_new_readers_first_reads_land() -> None:
    # Bytes count when a read lands. Right after a step up the old readers slow down
    # (they share the storage with the new ones) while the new readers' first reads are
    # still under way: measured then, the step would look like a loss.
    limit, clock = started(ceiling=32, start=8)

    def land(seconds: float, mib_per_s: float, read_s: float) -> None:
        for _ in range(round(seconds / TICK)):
            clock.now += TICK
            slot = limit.acquire(threading.Event())
            slot.read_done(int(mib_per_s * MiB * TICK), read_s)
            limit.release(slot)

    land(0.5, 320, read_s=0.2)  # eight readers, 0.2 s a read
    assert limit.limit == 16
    land(0.35, 160, read_s=0.4)  # the dip: the first reads of the eight new ones not in
    land(0.5, 600, read_s=0.4)  # sixteen readers, all landing
    assert limit.limit == 32
