"""The reads of a load split between hosts: each host reads its share of the model's
spans from its own mount of the mirror, and the hosts exchange every span over a gloo
group of one rank per host, so the mirror is read once in all. What each host read or
received goes to its :class:`~loaderplug.tensors.hosts.feed.SpanFeed`, which its load's
engine reads as it would the mirror: tensors are handed over, and a one pass's local
copy written, as the spans arrive.

The hosts advance in rounds, all together (:class:`~loaderplug.tensors.ranks.steps.Steps`:
watched, an error on any host raised on every host). At each round every host says
which span it read (or that it could not read one, or that it has nothing left), then
the spans' bytes are gathered, each host receiving the others'. While a round's bytes
travel, the host's readers read its next spans. Where the spans go:

* a span some host already has (its current copy, or its partial copy of a killed run)
  is read by that host from its own disk: a rerun resumes from what landed anywhere;
* any other span by the host ``index % hosts``, round-robin over the spans in the order
  the loads read them (file by file), so every host reads about 1/H of every file and
  the spans arrive about in the order each host's engine asks for them;
* a span a host could not read (its retries spent: EIO, ESTALE) by the next host that
  did not fail it; one no host can read fails the load on every host, naming it.

Each span read from the mirror is checked against the identity the hosts agreed on, so
a file replaced mid-load fails the load on every host; each host's engine publishes its
local copy, as any one pass does, only once every span landed and its mirror's file did
not change. The exchange failing (a host dead or stalled) leaves the partial copies and
their journals for the next run; a host whose load ended early says so in the next
round, and the others read the rest alone.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loaderplug.engine.retry import RetryPolicy, retrying
from loaderplug.engine.spans import Landed, Span, file_major
from loaderplug.errors import DistributedError, FileError, LoaderplugError
from loaderplug.jobs.current_copy import is_current_copy
from loaderplug.jobs.partial import partial_for, read_landed
from loaderplug.plugins.manager import Plugins
from loaderplug.settings import Settings
from loaderplug.storage.mounts import filesystem_type
from loaderplug.tensors.format.header import LENGTH_BYTES, header_length
from loaderplug.tensors.hosts.feed import SpanFeed
from loaderplug.tensors.ranks.agreement import same_files
from loaderplug.tensors.ranks.files import by_name
from loaderplug.tensors.ranks.steps import Steps
from loaderplug.types import Identity, IOPolicy
from loaderplug.units import MiB

# The span hosts exchange when LOADERPLUG_SPAN_BYTES is unset: big enough that a round's
# two small collectives cost little next to its bytes, small enough that the first
# spans land soon (the readers share the mount) and the rounds flow. Measured
# (benchmarks/multihost_bench.py, 1 GiB, 2 hosts, mirror 64 MiB/s a mount): 16 MiB
# spans 0.75x / 0.56x the side-by-side hydrate at 1 / 4 Gbit/s, 4 MiB 0.53x / 0.51x.
EXCHANGE_SPAN = 4 * MiB
MOST_READERS = 16
# The round after which the rates are compared: rounds 2 to 4 timed (the first pays for
# starting up). Measured (benchmarks/multihost_bench.py, 2 GiB, 2 hosts, mounts at 320
# MiB/s, links at 1 and 10 Gbit/s): deciding at round 6, auto took 1.10-1.12x the time of
# not splitting at all, the rounds before the decision and the group's start the cost.
DECIDED_AT = 4
# Readers side by side under LOADERPLUG_READERS=auto.
AUTO_READERS = 8


@dataclass(frozen=True)
class HostFile:
    """A file as one host sees it: its mirror's identity, and what its copy holds."""

    size: int
    mtime_ns: int
    current: bool  # the local copy is current: nothing to write
    landed: tuple[tuple[int, int], ...]  # durable in a partial copy a killed run left
    # Its first bytes up to the end of the header, as this host read them (empty where
    # it could not): a host whose mount fails there plans its load from another's.
    header: bytes = b""

    @property
    def header_digest(self) -> str:
        """The SHA-256 of its header ("" where this host could not read it): two hosts'
        mirrors holding files of one size and mtime but another layout are told apart
        before any span is exchanged."""
        return hashlib.sha256(self.header[LENGTH_BYTES:]).hexdigest() if self.header else ""

    def has(self, span: Span) -> bool:
        return self.current or Landed(self.landed).covers(span.offset, span.length)


@dataclass
class Exchanged:
    """What this host did: bytes read from its mirror and from its own disk, bytes
    received from the other hosts, and the rates the start of the exchange measured."""

    mirror_bytes: int = 0
    disk_bytes: int = 0
    received_bytes: int = 0
    rounds: int = 0
    exchange_s: float = 0.0  # in the rounds' gathers
    mirror_rate: float | None = None  # bytes/s, this host's mount while it read
    # Bytes/s of spans reaching this host, read or received, round after round: the pace
    # of the split as a whole (reads, gathers, lockstep), against the mirror's alone.
    split_rate: float | None = None
    rates: list[tuple[float | None, float | None]] = field(default_factory=list)  # each host's
    not_split: str | None = None  # why the hosts did not split at all


def ahead_bytes(settings: Settings) -> int:
    """The part of the host's memory budget the exchange's reads ahead may hold."""
    return settings.bytes_in_flight // 8


def feed_bytes(settings: Settings) -> int:
    """The part of the host's memory budget the feed may hold (spans received, not yet
    read by the load); the load itself runs within the rest."""
    return settings.bytes_in_flight // 4


class HostExchange:
    """The exchange of ``files`` among the hosts of ``steps``, into this host's ``feed``:
    :meth:`prepare` (the hosts agree on the files and on who reads what), then
    :meth:`rounds` (in a thread of its own while the load reads the feed). With
    ``keep_going(exchanged)`` asked after the round that measured the rates (False: stop,
    each host reads the rest alone)."""

    def __init__(
        self,
        files: list[Path],
        local: Path | None,
        steps: Steps,
        settings: Settings,
        feed: SpanFeed,
        keep_going: Callable[[Exchanged], bool] | None = None,
    ) -> None:
        # By name, the same on every host whatever order each was given them in: a span
        # names its file by its index here.
        self.files, self.local, self.steps = by_name(files), local, steps
        self.settings, self.feed, self.keep_going = settings, feed, keep_going
        self.hosts, self.me = steps.share.size, steps.share.rank
        self.span = settings.span_bytes or EXCHANGE_SPAN  # agreed by the hosts' caller
        self.done = Exchanged()
        self._paced: list[float] = []  # bytes reaching this host since round 1, its end
        self._spans: list[Span] = []
        self._states: list[list[HostFile]] = []
        self.finished = False  # every span reached every host
        self.abandoned = False  # this host's load ended early: the rounds stop

    def prepare(self, *, locked: bool = True) -> bool:
        """Agree on the files and on who reads which span; False where the hosts do not
        split (:attr:`Exchanged.not_split` says why). ``locked``: no other job holds
        this host's local folder (if any host's is held, none splits)."""
        same_files(self.steps, self.files, who="the host of rank", identify=None)
        mine = self._aligned(self._look)
        states = self._states_of(mine, locked)
        if states is None:
            self.feed.stop()
            return False
        self._states, self._spans = states, self._spans_of(states)
        for index in range(len(self.files)):
            heads = [
                host[index].header for host in (states[self.me], *states) if host[index].header
            ]
            self.feed.headers[index] = heads[0] if heads else b""
            mine = states[self.me][index]
            self.feed.agreed[index] = (mine.size, mine.mtime_ns)
        for span in self._spans:
            if not states[self.me][span.file].has(span):
                self.feed.expected[(span.file, span.offset)] = span.length
        return True

    def rounds(self) -> Exchanged:
        """Rounds until every host has every span (or the hosts stop splitting)."""
        reads = SpanReads(self, self._spans, self._states)
        try:
            self.finished = self._rounds(reads, self._spans)
        finally:
            reads.close()
        return self.done

    def _aligned(self, work: Callable[[], Any]) -> Any:
        """``work()``, between two collectives: a failure is told to every host."""
        try:
            return work()
        except DistributedError:
            raise
        except Exception as exc:
            self.steps.fail(exc)

    def _look(self) -> list[HostFile]:
        """Each file on this host: its mirror's identity, its local copy's state."""
        looked = []
        for path in self.files:
            try:
                identity = Identity.of(os.stat(path))
            except OSError as exc:
                what = f"cannot read {path}: {exc.strerror or exc}"
                raise FileError(what, path=str(path)) from exc
            current = False
            ranges: tuple[tuple[int, int], ...] = ()
            if self.local is not None:
                dst = self.local / path.name
                current = is_current_copy(dst, identity)
                landed = None if current else read_landed(dst, identity)
                ranges = landed.ranges if landed is not None else ()
            file = HostFile(identity.size, identity.mtime_ns, current, ranges, _header_of(path))
            looked.append(file)
        return looked

    def _states_of(self, mine: list[HostFile], locked: bool) -> list[list[HostFile]] | None:
        """Every host's files; None (not split, :attr:`Exchanged.not_split` says why)
        where a host's local folder is locked by another job, or the hosts' mirrors do
        not hold the same files (size, modification time and header): each host then
        loads its own, as it would alone."""
        said = self.steps.exchange(("files", (mine, locked)))
        states: list[list[HostFile]] = [s[1][0] for s in said if s is not None]
        unlocked = [h for h, s in enumerate(said) if s is not None and not s[1][1]]
        if unlocked:
            self.done.not_split = (
                f"the local folder of host #{unlocked[0]} is locked by another job (or "
                f"shared with another host)"
            )
            return None
        for index, path in enumerate(self.files):
            seen = {(host[index].size, host[index].mtime_ns) for host in states}
            # A header a host could not read (a range of its mount failing, which another
            # host reads for it) is compared by the others' alone.
            digests = {host[index].header_digest[:12] for host in states} - {""}
            if len(seen) > 1 or len(digests) > 1:
                self.done.not_split = (
                    f"{path.name} differs between the hosts' mirrors (size, mtime: "
                    f"{sorted(seen)}; header sha256: {sorted(digests)})"
                )
                return None
        return states

    def _spans_of(self, states: list[list[HostFile]]) -> list[Span]:
        """The spans some host lacks, in the order a load's engine reads them."""
        sizes = [file.size for file in states[0]]
        threshold = self.settings.split_threshold_bytes
        every = file_major(sizes, self.span, threshold)
        return [s for s in every if not all(host[s.file].has(s) for host in states)]

    def _rounds(self, reads: SpanReads, spans: list[Span]) -> bool:
        """Rounds until no host has a span left; False if ``keep_going`` said stop."""
        failed: dict[int, set[int]] = {}
        while True:
            word = self._aligned(
                lambda: ("stop", None) if self.abandoned else reads.next_header(self.done)
            )
            said = self.steps.exchange(word)
            if all(s is None for s in said):
                return True
            self.done.rounds += 1
            self._reassign(said, spans, failed, reads)
            self._move(said, spans, reads)
            if self._stops(said):
                reads.keep_read(self.feed)
                self.feed.stop()
                return False

    def _stops(self, said: list[Any]) -> bool:
        """Whether the hosts stop splitting after this round: a host's load ended early
        (the others read the rest alone), or ``keep_going`` says so once the rates are
        measured."""
        stopped = [h for h, s in enumerate(said) if s is not None and s[0] == "stop"]
        if stopped:
            self.done.not_split = f"host #{stopped[0]}'s load ended before the exchange did"
            return True
        if self.done.rounds != DECIDED_AT:
            return False
        self.done.rates = [
            s[1][2] if s is not None and s[0] != "stop" else (None, None) for s in said
        ]
        return self.keep_going is not None and not self.keep_going(self.done)

    def _reassign(
        self, said: list[Any], spans: list[Span], failed: dict[int, set[int]], reads: SpanReads
    ) -> None:
        """A span a host could not read goes to the next host that did not fail it."""
        for host, step in enumerate(said):
            if step is None or step[0] != "unreadable":
                continue
            index, why = step[1][0], step[1][1]
            failed.setdefault(index, set()).add(host)
            others = [(host + k) % self.hosts for k in range(1, self.hosts)]
            untried = [h for h in others if h not in failed[index]]
            if not untried:
                span = spans[index]
                raise LoaderplugError(
                    f"{self.files[span.file].name}: bytes {span.offset}-"
                    f"{span.offset + span.length} could not be read on any host; last: {why}"
                )
            if untried[0] == self.me:
                reads.add(index)

    def _pace(self, arrived: int) -> None:
        """Count a round's bytes into the split's pace (from the end of round 1)."""
        now = time.monotonic()
        if not self._paced:
            self._paced = [0.0, now]
            return
        self._paced[0] += arrived
        self.done.split_rate = self._paced[0] / max(now - self._paced[1], 1e-6)

    def _move(self, said: list[Any], spans: list[Span], reads: SpanReads) -> None:
        """The round's spans to every host, each kept in the feed where it is lacking."""
        lengths = [s[1][1] if s is not None and s[0] == "span" else 0 for s in said]
        longest = max(lengths)
        if longest == 0:
            return
        started = time.monotonic()
        gathered = self.steps.gather(reads.payload(longest))
        took = time.monotonic() - started
        self.done.exchange_s += took
        self._pace(sum(lengths))
        for host, (step, length) in enumerate(zip(said, lengths, strict=True)):
            if length == 0:
                continue
            span = spans[step[1][0]]
            if host != self.me:
                self.done.received_bytes += length
            if self.feed.wants(span.file, span.offset):
                data = memoryview(gathered[host].numpy())[:length]
                self.feed.put(span.file, span.offset, data)


class SpanReads:
    """This host's reads: its spans, read ahead by a pool of readers while the rounds
    exchange the earlier ones, each with the engine's retries."""

    def __init__(self, exchange: HostExchange, spans: list[Span], states: list[list[HostFile]]):
        settings = exchange.settings
        self._exchange, self._spans, self._mine = exchange, spans, states[exchange.me]
        holders = [[h for h, host in enumerate(states) if host[s.file].has(s)] for s in spans]
        # Round-robin over the spans no host has; a held span is read by its holder.
        order = iter(range(len(spans)))
        self._queue = [
            i for i in order if (holders[i][0] if holders[i] else i % exchange.hosts) == exchange.me
        ]
        # Spans read ahead (the memory budget) by the readers the setting asks for: more
        # readers side by side would only make each span, and the first round, later.
        self._ahead = max(1, min(MOST_READERS, ahead_bytes(settings) // exchange.span))
        # Spans the readers may have in flight now: one at first, so the first round's
        # span is read at the mount's whole pace (the first tensors wait for it), then
        # ``_ahead``.
        self._ramp = 1
        readers = settings.readers if isinstance(settings.readers, int) else AUTO_READERS
        self._readers = max(1, min(self._ahead, readers, len(self._queue)))
        self._pool = ThreadPoolExecutor(self._readers, thread_name_prefix="loaderplug-hosts")
        self._pending: list[tuple[int, Future[tuple[bytearray, float]]]] = []
        self._policy = RetryPolicy.of(settings)
        self._plugins = Plugins(settings)
        self._policies: dict[Path, IOPolicy] = {}
        self._sent: tuple[int, bytearray] | None = None
        self._timed: list[tuple[float, float, int]] = []  # each mirror read: start, end, bytes
        self._fill()

    def add(self, index: int) -> None:
        self._queue.append(index)
        self._fill()

    def _fill(self) -> None:
        while self._queue and len(self._pending) < min(self._ahead, self._ramp):
            index = self._queue.pop(0)
            self._pending.append((index, self._pool.submit(self._read, index)))

    def _source(self, span: Span) -> tuple[Path, bool]:
        """Where this host reads ``span``: its own copy if it has it, else its mirror."""
        path = self._exchange.files[span.file]
        file, local = self._mine[span.file], self._exchange.local
        if local is not None and file.current:
            return local / path.name, False
        if local is not None and file.has(span):
            return partial_for(local / path.name), False
        return path, True

    def _read(self, index: int) -> tuple[bytearray, float]:
        span = self._spans[index]
        path, from_mirror = self._source(span)
        buf = bytearray(span.length)
        agreed = self._mine[span.file]

        def read() -> None:
            # Through the source hook, as every read of a job: a plugin's source too.
            source = self._plugins.open_source(str(path), self._policy_of(path))
            try:
                view, done = memoryview(buf), 0
                while done < span.length:
                    got = source.pread_into(view[done:], span.offset + done)
                    if got == 0:
                        shrank = f"{path} ends before byte {span.offset + done}: it shrank"
                        raise FileError(shrank, path=str(path))
                    done += got
                if from_mirror:
                    _check_unchanged(path, source.identity(), agreed)
            finally:
                source.close()

        started = time.monotonic()
        retrying(read, self._policy, _give_up(path, span))
        ended = time.monotonic()
        if from_mirror:
            self._timed.append((started, ended, span.length))
        return buf, ended - started

    def _policy_of(self, path: Path) -> IOPolicy:
        """How ``path``'s folder is read: buffered, as a network mirror is; spans land in
        plain memory, which O_DIRECT refuses, and no probe of the mount is wanted (it
        would read the mirror again)."""
        folder = path.parent
        if folder not in self._policies:
            fs_type = filesystem_type(folder)
            self._policies[folder] = IOPolicy.buffered(fs_type, "read for the hosts' exchange")
        return self._policies[folder]

    def next_header(self, done: Exchanged) -> tuple[str, Any] | None:
        """This host's word for the next round: the span it read next, one it could not
        read, or None when it has none left; with the rates it measured."""
        self._sent = None
        if not self._pending:
            return None
        index, future = self._pending.pop(0)
        self._ramp = self._ahead
        self._fill()
        try:
            buf, _ = future.result()
        except OSError as exc:
            return ("unreadable", (index, str(exc), self._rates(done)))
        span = self._spans[index]
        if self._source(span)[1]:
            done.mirror_bytes += span.length
        else:
            done.disk_bytes += span.length
        self._sent = (index, buf)
        return ("span", (index, span.length, self._rates(done)))

    def _rates(self, done: Exchanged) -> tuple[float | None, float | None]:
        """The mount's rate (the bytes its readers read, side by side, over the time some
        read was in flight: not the time they waited for the rounds to take their
        spans), and the split's pace, as measured so far."""
        timed = sorted(self._timed)
        if timed:
            busy, until = 0.0, timed[0][0]
            for start, end, _ in timed:
                busy += max(0.0, end - max(start, until))
                until = max(until, end)
            done.mirror_rate = sum(n for _, _, n in timed) / max(busy, 1e-6)
        return done.mirror_rate, done.split_rate

    def payload(self, longest: int) -> Any:
        """What this host puts into the round's gather: its span, padded to ``longest``."""
        import torch

        if self._sent is not None and len(self._sent[1]) == longest > 0:
            return torch.frombuffer(self._sent[1], dtype=torch.uint8)
        padded = torch.zeros(longest, dtype=torch.uint8)
        if self._sent is not None and len(self._sent[1]):
            padded[: len(self._sent[1])] = torch.frombuffer(self._sent[1], dtype=torch.uint8)
        return padded

    def keep_read(self, feed: SpanFeed) -> None:
        """Keep what this host read and did not send in its feed, so each host, reading
        the rest alone, does not read it again."""
        for index, future in self._pending:
            span = self._spans[index]
            try:
                buf, _ = future.result()
            except (OSError, LoaderplugError):
                continue  # read again by the load, which says why if it fails again
            if feed.wants(span.file, span.offset):
                feed.put(span.file, span.offset, memoryview(buf))
        self._pending.clear()

    def close(self) -> None:
        self._queue.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _give_up(path: Path, span: Span) -> Callable[[OSError, int | None], Exception]:
    def give_up(exc: OSError, attempts: int | None) -> Exception:
        tries = f" after {attempts} attempts" if attempts else ""
        where = f"{path}: bytes {span.offset}-{span.offset + span.length}"
        return OSError(exc.errno, f"{where}: {exc.strerror or exc}{tries}")

    return give_up


def _check_unchanged(path: Path, now: Identity, agreed: HostFile) -> None:
    """A span read from a mirror file that is not the one the hosts agreed on (replaced
    or rewritten since) fails the load on every host: never a mix of two versions."""
    if (now.size, now.mtime_ns) != (agreed.size, agreed.mtime_ns):
        raise FileError(
            f"{path} changed while the hosts read it ({now.describe()}); nothing of it "
            f"was published: run again once the mirror is settled",
            path=str(path),
        )


def _header_of(path: Path) -> bytes:
    """``path``'s bytes up to the end of its header as this host reads them, or b""
    where this host cannot (the exchange reads such a range from another host)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = f.read(LENGTH_BYTES)
            n = header_length(str(path), length, size)
            header = f.read(n)
    except (OSError, LoaderplugError):
        return b""
    return length + header if len(header) == n else b""
