"""Heartbeats in a store: how ranks that cannot see each other's processes (another pid
namespace, another host) tell a death from a slow step.

The store traffic grows linearly with the ranks. Every rank counts up a key of its own
every :data:`BEAT_S` (one operation). One rank, the watcher (the group's lowest), reads
every other rank's count in one ``multi_get``; every other rank reads only the
watcher's count and the key that names a dead rank, also in one ``multi_get``. A rank
that sees a death (a count that stood still, or a process that exited) writes it under
that key, so every rank hears of it at its next beat. Per beat that is two operations a
rank and about three keys, where every rank reading every other would cost each rank
one operation per rank: at 512 ranks, 4,096 operations a second instead of a million
(``benchmarks/heartbeat_bench.py``).

A slow store is not a dead host. A count that stood still for :data:`SILENT_S` is a
death only if the store answered this rank :data:`ANSWERS_FOR_SILENCE` times meanwhile
(it was serving beats, and that one's stopped); and the store itself, served on rank
0's host, is taken for gone (that host died, or the network to it stalled) only once it
kept this rank waiting :data:`SILENT_S` and :data:`STORE_PATIENCE` times the slowest
answer it gave lately.

Every watch keeps its keys under a prefix of its own, fresh for each load (the store it
is given is so prefixed: :func:`loaderplug.tensors.ranks.world.heartbeat_store`): a load's
group bears the same name as the last one's, and a death named in that load, or a count
that stood still at its end, must never reach the next. Once its last beat is done, each
rank counts itself out under :data:`LEFT_KEY`, and the last one out removes the keys
(nobody reads them any more); a rank that died never counts out, and its load's keys
stay where no later load looks.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# How often a rank counts its heartbeat up, and how long one may stand still before its
# rank is taken for dead: long next to a beat (a thread of a busy process may wait for
# the interpreter's lock a while), short next to the collective timeout.
BEAT_S = 0.25
SILENT_S = 5.0
# A count that stood still is a death only once the store answered this rank this many
# times since it last moved: a store too slow to serve beats stills every count.
ANSWERS_FOR_SILENCE = 4
# The store is gone once it kept this rank waiting this many times its slowest recent
# answer (and SILENT_S at least).
STORE_PATIENCE = 4
# The key naming a rank seen dead ("-1": none).
DEAD_KEY = "dead"
NOBODY = -1
# The key each rank counts itself out on, past its last beat.
LEFT_KEY = "left"


@dataclass(frozen=True)
class Peer:
    """Another rank of the share, by its rank in the default group and its process id
    (None: in another pid namespace, where this rank cannot see it; watched by its
    heartbeat)."""

    rank: int
    pid: int | None
    hostname: str | None = None  # set for a rank on another host


class Heartbeats:
    """This rank's heartbeat in ``store`` (under a prefix of the load's own) and its
    watch on ``peers``, as the module says: :meth:`beat` counts this rank's up and says
    which peers died since the last beat; :meth:`tell` has the next beat tell the others
    of a death this rank saw itself; :meth:`leave` ends it. The watcher is the lowest
    rank of this one and ``peers``. Beats come from one thread, :meth:`tell` and
    :meth:`unanswered` from another: what both touch is kept under a lock, never held
    over a store's operation (a store that stalls must not stall the other thread)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        peers: Sequence[Peer],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store, self._rank, self._clock = store, rank, clock
        self._known = {peer.rank: peer for peer in peers}
        self._members = len(self._known) + 1
        self.watcher = min([rank, *self._known])
        self.keeper = self._known.get(0)  # the store's host, where rank 0 is a peer
        if self.watcher == rank:
            watched = [peer for peer in peers if peer.pid is None]
        else:  # the watcher's own count, where its process cannot be watched
            watcher = self._known[self.watcher]
            watched = [watcher] if watcher.pid is None else []
        now = clock()
        # Each watched peer's count, when it last moved, and this rank's answers then.
        self._last = {peer: (-1, now, 0) for peer in watched}
        self._keys = [DEAD_KEY, *(str(peer.rank) for peer in watched)]
        self._answers, self._answered = 0, now
        self._latencies: collections.deque[float] = collections.deque(maxlen=32)
        self._started = False
        self._lock = threading.Lock()
        self._to_tell: Peer | None = None
        self._heard: set[int] = set()  # the dead this rank was told of, or told

    @property
    def watching(self) -> bool:
        return self.watcher == self._rank

    def tell(self, peer: Peer) -> None:
        """Have the next beat name ``peer`` dead to every rank (the first one only)."""
        with self._lock:
            if self._to_tell is None and peer.rank not in self._heard:
                self._to_tell = peer

    def beat(self) -> list[Peer]:
        """Count up this rank's heartbeat; the peers dead since the last beat (the
        store's keeper, if the store failed)."""
        store = self._store
        if store is None:
            return []
        asked = self._clock()
        try:
            values = self._exchange(store)
        except Exception:  # a store that failed says nothing more of the peers
            log.warning("loaderplug: the ranks' heartbeats stop (the store failed)", exc_info=True)
            self._store = None
            return [self.keeper] if self.keeper is not None else []
        now = self._clock()
        with self._lock:
            self._answered, self._answers = now, self._answers + 1
            self._latencies.append(now - asked)
        return self._told(int(values[0])) + self._silent(values[1:], now)

    def leave(self) -> None:
        """End this rank's beats (called past its last one): count it out, and where it
        is the last rank out, remove every key of the watch. Best effort: a store that
        fails here is only logged, the load is over."""
        store, self._store = self._store, None
        if store is None:
            return
        try:
            if store.add(LEFT_KEY, 1) < self._members:
                return  # another still beats, and reads these keys
            for key in [DEAD_KEY, LEFT_KEY, *(str(r) for r in [self._rank, *self._known])]:
                store.delete_key(key)
        except Exception:
            log.debug("loaderplug: the heartbeats' keys are left in the store", exc_info=True)

    def unanswered(self) -> Peer | None:
        """The store's keeper, once the store kept this rank waiting too long (see the
        module): its host died, or the network to it stalled."""
        if self._store is None or self.keeper is None:
            return None
        with self._lock:
            slowest, answered = max(self._latencies, default=0.0), self._answered
        patience = max(SILENT_S, STORE_PATIENCE * slowest)
        return self.keeper if self._clock() - answered >= patience else None

    def _exchange(self, store: Any) -> list[bytes]:
        """This beat's operations: one count up, one read (and a death to tell)."""
        if not self._started:
            # Every key read exists before the first read (a read of a missing key waits).
            for key in self._keys[1:]:
                store.add(key, 0)
            store.compare_set(DEAD_KEY, "", str(NOBODY))
            self._started = True
        store.add(str(self._rank), 1)
        with self._lock:  # taken at once: a death told meanwhile waits for the next beat
            telling, self._to_tell = self._to_tell, None
            if telling is not None:
                self._heard.add(telling.rank)
        if telling is not None:
            store.set(DEAD_KEY, str(telling.rank))
        values: list[bytes] = store.multi_get(self._keys)
        return values

    def _told(self, dead: int) -> list[Peer]:
        """The rank another named dead, once (never this one: it is alive)."""
        if dead in (NOBODY, self._rank):
            return []
        with self._lock:
            if dead in self._heard:
                return []
            self._heard.add(dead)
        return [self._known.get(dead, Peer(dead, None))]

    def _silent(self, counts: Sequence[bytes], now: float) -> list[Peer]:
        silent = []
        for peer, value in zip(list(self._last), counts, strict=True):
            count, since, answers = self._last[peer]
            if int(value) != count:
                self._last[peer] = (int(value), now, self._answers)
            elif (
                # It beat, then stopped (the keys are this watch's own: any count above
                # 0 is a beat of this load's, never one left by an earlier load).
                count > 0
                and now - since >= SILENT_S
                and self._answers - answers >= ANSWERS_FOR_SILENCE
            ):
                silent.append(peer)
        for peer in silent:  # told once, here and to every rank
            del self._last[peer]
            self.tell(peer)
            with self._lock:
                self._heard.add(peer.rank)
        if silent:
            self._keys = [DEAD_KEY, *(str(peer.rank) for peer in self._last)]
        return silent
