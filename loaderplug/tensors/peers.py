"""Watching the processes of the ranks a host shares a load with, so a death is noticed
in milliseconds instead of after the collective timeout.

A rank that dies closes its sockets, and gloo usually fails the collective that waits
on it at once, but not always: measured here (two ranks one-passing 2 GiB from the FUSE
test volume with the default settings, one killed at a random point), two kills in eight
left the survivor waiting in a receive until ``LOADERPLUG_DISTRIBUTED_TIMEOUT_S`` ran
out. And a rank that is reading its own files, or whose consumer holds a tensor, is in
no collective at all.

Ranks on one host know each other's process ids (their first step gathers them), so each
rank watches the others' processes directly: a pidfd becomes readable the moment its
process exits (a zombie included). Only a process in this rank's pid namespace can be
watched; a rank of another container or host is left to the collectives' own failure
and timeout. A rank that is merely slow is never taken for dead: only an exit counts.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loaderplug.errors import DistributedError

__all__ = ["Peer", "PeerWatch", "pid_namespace"]

# Where pidfds are not to be had (Linux before 5.3, some sandboxes): how often the
# peers' entries in /proc are looked at instead.
PROC_POLL_S = 0.25


@dataclass(frozen=True)
class Peer:
    """Another rank of the share, by its rank in the default group and its process id."""

    rank: int
    pid: int


def pid_namespace() -> str | None:
    """This process's pid namespace (process ids mean the same within one only)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


class PeerWatch:
    """Watches ``peers`` from a thread of its own until :meth:`close`; :attr:`dead` is the
    first one seen to exit, and every listener hears of it once, on that thread."""

    def __init__(self, peers: Sequence[Peer]) -> None:
        self.dead: Peer | None = None
        self._death = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[Peer], None]] = []
        self._by_fd: dict[int, Peer] = {}
        self._polled: list[Peer] = []  # no pidfd: looked up in /proc
        for peer in peers:
            try:
                self._by_fd[os.pidfd_open(peer.pid)] = peer
            except ProcessLookupError:
                self.dead = self.dead or peer
                self._death.set()
            except (OSError, AttributeError):
                self._polled.append(peer)
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="loaderplug-peers", daemon=True)
        self._thread.start()

    def on_death(self, listener: Callable[[Peer], None]) -> None:
        """Call ``listener(peer)`` when a peer dies (at once if one has)."""
        with self._lock:
            dead = self.dead
            if dead is None:
                self._listeners.append(listener)
        if dead is not None:
            listener(dead)

    def check(self, wait_s: float = 0.0) -> None:
        """Raise the :class:`DistributedError` of a dead peer, if one died (or dies
        within ``wait_s``: a collective that failed may have seen the death first)."""
        if wait_s:
            self._death.wait(wait_s)
        if self.dead is not None:
            raise self.error(self.dead)

    @staticmethod
    def error(peer: Peer) -> DistributedError:
        return DistributedError(
            f"rank {peer.rank} of the shared load died (process {peer.pid} on this host "
            f"exited before the load was done); this rank stops too"
        )

    def close(self) -> None:
        """Stop watching (the load is over: a peer may now exit as it likes)."""
        with self._lock:
            self._listeners.clear()
        if self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join()
        for fd in [*self._by_fd, self._wake_r, self._wake_w]:
            os.close(fd)
        self._by_fd.clear()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in self._by_fd:
            poller.register(fd, select.POLLIN)
        timeout_ms = int(PROC_POLL_S * 1000) if self._polled else None
        if self.dead is not None:
            self._died(self.dead)
        while True:
            for fd, _ in poller.poll(timeout_ms):
                if fd == self._wake_r:
                    return
                poller.unregister(fd)
                self._died(self._by_fd[fd])
            for peer in [p for p in self._polled if not _alive(p.pid)]:
                self._polled.remove(peer)
                self._died(peer)

    def _died(self, peer: Peer) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = peer
            listeners, self._listeners = self._listeners, []
        self._death.set()
        for listener in listeners:
            listener(peer)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited: it only waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: never take a peer for dead on a guess
    # The state follows the command name, which is in parentheses and may hold any byte.
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")
