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
watched so (a process id means nothing in another); a rank of this host in another pid
namespace (a container of its own, with the host's network and files) is watched by its
heartbeat instead (:mod:`loaderplug.tensors.ranks.heartbeats`): each such rank counts up a
key of its own in the group's store from a thread of its own, and one whose count stood
still for ``SILENT_S`` while the store kept answering has died. A rank that is merely
slow is never taken for dead: only an exit counts, or a heartbeat that stopped for far
longer than any slow step takes. The hosts that split a one pass
(:mod:`loaderplug.tensors.hosts.split`) watch each other's leading rank by heartbeat
too: a pidfd cannot see another host, and a host whose network stalls closes no socket.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable, Sequence

from loaderplug.errors import DistributedError
from loaderplug.tensors.ranks.heartbeats import BEAT_S, SILENT_S, Heartbeats, Peer

log = logging.getLogger(__name__)

__all__ = ["Heartbeats", "Peer", "PeerWatch", "pid_namespace"]

# Where pidfds are not to be had (Linux before 5.3, some sandboxes): how often the
# peers' entries in /proc are looked at instead.
PROC_POLL_S = 0.25


# How long a failed collective waits for a peer's exit to be seen, to name it: a peer's
# death closes its sockets a moment before its process is seen to exit.
PEER_EXIT_S = 1.0

# How long closing a watch waits for its heartbeat's last beat and leave (a few of the
# store's answers, so the load's keys are gone when the load is), and no longer: a
# store that stalls is left to the heartbeat's thread, never to the load.
LEAVE_S = 1.0


def pid_namespace() -> str | None:
    """This process's pid namespace (process ids mean the same within one only)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


class PeerWatch:
    """Watches ``peers`` from a thread of its own until :meth:`close`: by their processes,
    or by ``heartbeats`` (those in another pid namespace). :attr:`dead` is the first one
    seen to exit, and every listener hears of it once, on that thread."""

    def __init__(self, peers: Sequence[Peer], heartbeats: Heartbeats | None = None) -> None:
        self.dead: Peer | None = None
        self._death = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[Peer], None]] = []
        self._by_fd: dict[int, Peer] = {}
        self._polled: list[tuple[Peer, int]] = []  # no pidfd: looked up in /proc
        self._heartbeats = heartbeats
        for peer in peers:
            if peer.pid is None:
                continue  # another pid namespace: its heartbeat tells
            try:
                self._by_fd[os.pidfd_open(peer.pid)] = peer
            except ProcessLookupError:
                self.dead = self.dead or peer
                self._death.set()
            except (OSError, AttributeError):
                self._polled.append((peer, peer.pid))
        # A failed collective waits this long to see whether a peer died, to name it.
        self.settle_s = SILENT_S + 2 * BEAT_S if heartbeats is not None else PEER_EXIT_S
        # On a thread of its own: a store that stopped answering blocks it, not the watch.
        self._beating = threading.Thread(
            target=self._beat, name="loaderplug-heartbeat", daemon=True
        )
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
        if peer.hostname is not None:
            return DistributedError(
                f"host {peer.hostname} (rank {peer.rank}) of the shared load stopped "
                f"answering: its heartbeat stood still for {SILENT_S:g} s (the host died, "
                f"or the network to it stalled); this rank stops too"
            )
        if peer.pid is None:
            return DistributedError(
                f"rank {peer.rank} of the shared load died (its heartbeat stopped for "
                f"{SILENT_S:g} s; it runs on this host, in another pid namespace); this "
                f"rank stops too"
            )
        return DistributedError(
            f"rank {peer.rank} of the shared load died (process {peer.pid} on this host "
            f"exited before the load was done); this rank stops too"
        )

    def close(self) -> None:
        """Stop watching (the load is over: a peer may now exit as it likes)."""
        with self._lock:
            self._listeners.clear()
        self._closed.set()  # a beat waiting for the store is left to it (a daemon)
        if self._thread.is_alive():
            os.write(self._wake_w, b"x")
            self._thread.join()
        if self._beating.ident is not None:  # started by the watch's thread
            self._beating.join(LEAVE_S)
        for fd in [*self._by_fd, self._wake_r, self._wake_w]:
            os.close(fd)
        self._by_fd.clear()

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in self._by_fd:
            poller.register(fd, select.POLLIN)
        timeout_s = min(
            [PROC_POLL_S] * bool(self._polled) + [BEAT_S] * (self._heartbeats is not None),
            default=None,
        )
        timeout_ms = int(timeout_s * 1000) if timeout_s is not None else None
        if self.dead is not None:
            self._died(self.dead)
        if self._heartbeats is not None:
            self._beating.start()
        while True:
            for fd, _ in poller.poll(timeout_ms):
                if fd == self._wake_r:
                    return
                poller.unregister(fd)
                self._died(self._by_fd[fd])
            for peer, pid in [(p, pid) for p, pid in self._polled if not _alive(pid)]:
                self._polled.remove((peer, pid))
                self._died(peer)
            unanswered = self._heartbeats.unanswered() if self._heartbeats is not None else None
            if unanswered is not None:
                self._died(unanswered)

    def _beat(self) -> None:
        """Beat at once (a peer counts this rank's silence from it), then every
        :data:`BEAT_S` until the watch is closed; then leave (past the last beat, as
        :meth:`Heartbeats.leave` wants)."""
        heartbeats = self._heartbeats
        assert heartbeats is not None
        try:
            while True:
                for peer in heartbeats.beat():
                    self._died(peer)
                if self._closed.wait(BEAT_S):
                    return
        finally:
            heartbeats.leave()

    def _died(self, peer: Peer) -> None:
        if self._heartbeats is not None:
            self._heartbeats.tell(peer)  # ranks that cannot see it hear of it at once
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
