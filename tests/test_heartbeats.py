"""Heartbeats in a real torch store: a rank that stops beating is named, a slow store is
not a dead host, a store that stops answering names rank 0's host, the store's traffic
grows linearly with the ranks, a death told while a beat runs is never lost, and the
last rank out takes the keys out of the store."""

from __future__ import annotations

import datetime
import threading
import time
from collections import Counter
from typing import Any

import pytest

from loaderplug.tensors.ranks.heartbeats import (
    ANSWERS_FOR_SILENCE,
    BEAT_S,
    SILENT_S,
    STORE_PATIENCE,
    Heartbeats,
    Peer,
)
from loaderplug.tensors.ranks.peers import PeerWatch

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")


class Clock:
    """Time as the test says it is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Counted:
    """A store that counts the operations asked of it, and can be slowed."""

    def __init__(self, store: Any, clock: Clock | None = None, takes_s: float = 0.0) -> None:
        self.store, self.clock, self.takes_s = store, clock, takes_s
        self.operations: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        operation = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.operations[name] += 1
            if self.clock is not None:
                self.clock.now += self.takes_s
            return operation(*args)

        return counted


def ranks(store: Any, size: int, clock: Clock) -> list[Heartbeats]:
    """``size`` ranks that cannot see each other's processes, each watching the others."""
    return [
        Heartbeats(store, r, [Peer(p, None) for p in range(size) if p != r], clock=clock)
        for r in range(size)
    ]


def beat_all(beats: list[Heartbeats], clock: Clock, skip: set[int] = frozenset()) -> list[Any]:
    said = [b.beat() if r not in skip else [] for r, b in enumerate(beats)]
    clock.now += BEAT_S
    return said


def hash_store() -> Any:
    from torch.distributed import HashStore

    return HashStore()


def test_a_rank_that_stops_beating_is_named_by_the_watcher_then_by_every_rank() -> None:
    clock = Clock()
    beats = ranks(hash_store(), 4, clock)
    assert beats[0].watching and not beats[1].watching
    for _ in range(int(SILENT_S / BEAT_S) * 2):  # everyone beats: no one is dead
        assert beat_all(beats, clock) == [[], [], [], []]
    seen: dict[int, list[Peer]] = {}
    for _ in range(int(SILENT_S / BEAT_S) + ANSWERS_FOR_SILENCE + 2):
        for rank, said in enumerate(beat_all(beats, clock, skip={2})):
            seen.setdefault(rank, []).extend(said)
    # Named once on each rank that is left: by the watcher, then by the key it wrote.
    assert seen == {0: [Peer(2, None)], 1: [Peer(2, None)], 2: [], 3: [Peer(2, None)]}


def test_a_watcher_that_stops_beating_is_named_by_the_others() -> None:
    clock = Clock()
    beats = ranks(hash_store(), 3, clock)
    beat_all(beats, clock)
    said: list[Any] = []
    for _ in range(int(SILENT_S / BEAT_S) + ANSWERS_FOR_SILENCE + 2):
        said.extend(beat_all(beats, clock, skip={0}))
    assert [p for each in said for p in each] == [Peer(0, None), Peer(0, None)]


def test_a_death_a_rank_saw_itself_reaches_every_rank_at_the_next_beat() -> None:
    clock = Clock()
    beats = ranks(hash_store(), 3, clock)
    beat_all(beats, clock)
    beats[2].tell(Peer(1, 4242))  # as when it saw rank 1's process exit
    assert beat_all(beats, clock) == [[], [], []]  # rank 2 wrote it after the others read
    assert beat_all(beats, clock) == [[Peer(1, None)], [], []]
    assert beat_all(beats, clock) == [[], [], []]  # told once


def test_a_slow_store_is_not_a_dead_host() -> None:
    """Every operation takes 2 s: counts move seldom, answers come late, no one dies."""
    clock = Clock()
    store = Counted(hash_store(), clock, takes_s=2.0)
    beats = ranks(store, 3, clock)
    beats[1].keeper = Peer(0, None, "host0")
    for _ in range(20):  # 20 rounds of 12 s each (three ranks, two operations each)
        assert beat_all(beats, clock) == [[], [], []]
        assert beats[1].unanswered() is None
    # Its slowest answer took 8 s (the first beat's four operations): it is waited for
    # STORE_PATIENCE times as long.
    clock.now += STORE_PATIENCE * 8.0 - 10
    assert beats[1].unanswered() is None
    clock.now += 10
    assert beats[1].unanswered() == Peer(0, None, "host0")


def test_a_store_that_fails_or_keeps_silent_names_rank_0s_host() -> None:
    """The store is served on rank 0's host: its failure, or a wait on it as long as a
    silent heartbeat, is that host's end (where rank 0 is a peer at all)."""

    class DeadStore:
        def add(self, key: str, amount: int) -> int:
            raise RuntimeError("Connection reset by peer")

    keeper = Peer(0, None, "host0")
    assert Heartbeats(DeadStore(), 1, [keeper]).beat() == [keeper]
    assert Heartbeats(DeadStore(), 2, [Peer(1, None)]).beat() == []  # rank 0 not a peer
    clock = Clock()
    beats = Heartbeats(hash_store(), 1, [keeper], clock=clock)
    beats.beat()
    clock.now += SILENT_S - 0.1
    assert beats.unanswered() is None
    clock.now += 0.2  # and the next answer never came
    assert beats.unanswered() == keeper


@pytest.mark.parametrize("size", [8, 64])
def test_store_operations_grow_linearly_with_the_ranks(size: int) -> None:
    """Two operations a rank a beat (its count up, one read), whatever the ranks."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    store = Counted(server)
    clock = Clock()
    beats = ranks(store, size, clock)
    beat_all(beats, clock)  # the first beat makes the keys
    store.operations.clear()
    started = time.monotonic()
    for _ in range(3):
        assert beat_all(beats, clock) == [[]] * size
    assert store.operations == {"add": 3 * size, "multi_get": 3 * size}, time.monotonic() - started


class Interleaved(Heartbeats):
    """Heartbeats whose beat, at the moment it takes the death it has to tell, lets
    another thread's :meth:`tell` run first (as a switch of threads there would)."""

    teller: threading.Thread | None = None

    @property  # type: ignore[override]
    def _to_tell(self) -> Peer | None:
        taken = self.__dict__.get("slot")
        teller, self.teller = self.teller, None
        if teller is not None:
            teller.start()
            # A tell() that waits for the beat to be done with the slot goes on after it.
            teller.join(timeout=1.0)
        return taken

    @_to_tell.setter
    def _to_tell(self, peer: Peer | None) -> None:
        self.__dict__["slot"] = peer


def test_a_death_told_while_a_beat_takes_the_last_one_reaches_every_rank() -> None:
    """Rank 2 is told of rank 1's death (its process exited) by the watch's thread just
    as its beat takes what there is to tell: the next beat tells it, and rank 0 hears."""
    clock = Clock()
    store = hash_store()
    beats = ranks(store, 3, clock)
    beats[2] = Interleaved(store, 2, [Peer(0, None), Peer(1, None)], clock=clock)
    beat_all(beats, clock)
    teller = threading.Thread(target=beats[2].tell, args=(Peer(1, 4242),))
    beats[2].teller = teller
    assert beats[2].beat() == []
    teller.join()
    heard = [beat_all(beats, clock)[0] for _ in range(2)]
    assert [peer for said in heard for peer in said] == [Peer(1, None)]


def tcp_store() -> Any:
    from torch.distributed import TCPStore

    # A read of a key taken out too early fails in seconds, not the default minutes.
    return TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))


def test_the_last_rank_out_takes_the_keys_out_and_not_before() -> None:
    from torch.distributed import PrefixStore

    server = tcp_store()
    before = server.num_keys()
    clock = Clock()
    beats = ranks(PrefixStore("a load/", server), 3, clock)
    beat_all(beats, clock)
    beats[0].tell(Peer(2, 4242))
    assert beat_all(beats, clock)[1] == [Peer(2, None)]  # as the watcher named it
    beats[0].leave()
    beats[2].leave()
    # Rank 1 still reads the dead and the watcher's count: they are there (a read of a
    # key taken out would wait, then take the store, and rank 0's host, for gone).
    assert beats[1].beat() == []
    beats[1].leave()
    assert server.num_keys() == before
    assert beats[1].beat() == []  # past its leave, a beat asks nothing of the store


def test_the_watches_of_a_load_leave_no_key_behind() -> None:
    """Two ranks watching each other by heartbeat, their watches closed at the load's
    end: the store holds what it held before."""
    server = tcp_store()
    before = server.num_keys()
    watches = [
        PeerWatch([Peer(1 - r, None)], Heartbeats(server, r, [Peer(1 - r, None)])) for r in (0, 1)
    ]
    for watch in watches:
        watch.close()
    # Closing waits for the last beat a moment, and no longer: on a busy machine the
    # keys may go a little after.
    deadline = time.monotonic() + 60
    while server.num_keys() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.num_keys() == before
    assert all(watch.dead is None for watch in watches)
