"""Ranks on several hosts: the hosts split the load's reads of the mirror.

A model served across hosts is loaded by every host, each from its own mount of the
network volume: read alone, the volume serves the model once per host. When the group's
ranks run on two or more hosts, one rank per host (its lowest) takes part in a
:class:`~loaderplug.tensors.hosts.exchange.HostExchange`: each host reads about 1/H of
the spans and receives the rest from the other hosts, over a gloo group of those ranks
(torch.distributed is the transport: the job's own network, no socket of loaderplug's).
That rank's load reads what arrives as it would read the mirror
(:mod:`loaderplug.tensors.hosts.feed`): each tensor is handed over once its bytes are in
memory, and a one pass writes its local copy from the same bytes. The host's other ranks
get every tensor from it as ranks of a host share any load
(:mod:`loaderplug.tensors.ranks.shared`): by the copy in the page cache in a one pass,
by broadcast when streaming (no local copy to map).

Which ranks share a host comes from torchrun's variables where they are set, else from
what each rank sees of its machine (:class:`~loaderplug.tensors.ranks.world.World`).
Whether to split is measured, not configured (``LOADERPLUG_HOST_SPLIT=auto``): the first
rounds time the mirror's reads and the exchange, and the hosts stop splitting (each
reads the rest alone, keeping what it read or received) unless the exchange is the
faster.

A host that dies or whose network stalls is noticed by its heartbeat within seconds
(:mod:`loaderplug.tensors.ranks.peers`); every rank of every host then fails, naming it.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderplug.errors import LockError
from loaderplug.jobs.locks import Lock, folder_lock
from loaderplug.plugins.manager import Plugins
from loaderplug.settings import Settings
from loaderplug.tensors.hosts.exchange import (
    AUTO_READERS,
    EXCHANGE_SPAN,
    Exchanged,
    HostExchange,
    ahead_bytes,
    feed_bytes,
)
from loaderplug.tensors.hosts.feed import ExchangeOpener, SpanFeed
from loaderplug.tensors.ranks.groups import agreed_group, over
from loaderplug.tensors.ranks.peers import Peer
from loaderplug.tensors.ranks.steps import Steps
from loaderplug.tensors.ranks.teardown import tear_down
from loaderplug.tensors.ranks.world import Share, World, heartbeat_store, watch
from loaderplug.units import MiB


@dataclass(frozen=True)
class HostsChoice:
    """What a load across hosts did: the hosts, whether they split the reads and why,
    and (on each host's leading rank) what its host read, received and measured."""

    hosts: int
    split: bool
    why: str
    exchanged: Exchanged | None = None

    def describe(self) -> str:
        said = f"{self.hosts} hosts, reads {'split' if self.split else 'not split'}: {self.why}"
        done = self.exchanged
        if done is not None:
            said += (
                f"; this host read {done.mirror_bytes / MiB:.0f} MiB from its mirror, "
                f"received {done.received_bytes / MiB:.0f} MiB"
            )
        return said


def hosts_said(settings: Settings, environ: Mapping[str, str]) -> str:
    """What ``doctor`` says of ranks on several hosts: how this host is told apart from
    the others, and whether a one pass would split its reads between them."""
    if settings.host_id:
        known = f"this host is {settings.host_id!r} (LOADERPLUG_HOST_ID)"
    elif "GROUP_RANK" in environ and "LOCAL_WORLD_SIZE" in environ:
        nodes = environ.get("GROUP_WORLD_SIZE", "?")
        known = (
            f"torchrun node {environ['GROUP_RANK']} of {nodes}, "
            f"{environ['LOCAL_WORLD_SIZE']} rank(s) here"
        )
    else:
        known = "hosts told apart by name, boot, mount namespace and local folder"
    rule = {
        "off": "every host reads the whole model (LOADERPLUG_HOST_SPLIT=off)",
        "on": "a load on two or more hosts splits the mirror's reads (forced on)",
        "auto": "a load on two or more hosts splits the mirror's reads while the "
        "exchange measured in its first rounds beats the mirror; one host: never",
    }[settings.host_split]
    return f"hosts: {known}; {rule}"


def split_across_hosts(
    paths: Sequence[str | os.PathLike[str]],
    local_dir: str | os.PathLike[str] | None,
    world: World | None,
    share: Share | None,
    settings: Settings,
) -> HostSplit | None:
    """This rank's part in a load split across the hosts of ``world`` (see above); None
    where there is one host. ``share`` is this host's ranks (None: this rank alone
    here). A failure on a host of several ranks is kept (:attr:`HostSplit.error`) for
    the host's shared load to raise on every rank of it at its first step."""
    if world is None:
        return None
    layout = world.hosts()
    if len(layout) < 2:
        return None
    # Rank 0's settings on every host: hosts that split differently would part ways.
    mode, span, threshold = world.ranks[0].split
    settings = settings.replace(host_split=mode, split_threshold_bytes=threshold)
    settings = settings.replace(span_bytes=span or EXCHANGE_SPAN)
    here = next(host for host in layout if world.me in host)
    split = HostSplit(len(layout), here[0] == world.me, settings)
    if settings.host_split == "off":
        return split
    try:
        group = _leaders_group(world, settings)
        if split.leader:
            split.begin([Path(p) for p in paths], local_dir, world, group)
    except Exception as exc:
        if share is None:
            raise
        split.error = exc
    return split


class HostSplit:
    """A load's part in a split across hosts, on one rank. On a host's leading rank it
    runs the exchange (its rounds in a thread of their own) and gives its load the
    opener the engine reads through (:class:`~loaderplug.tensors.hosts.feed.
    ExchangeOpener`); the host's other ranks own no file of the load and get every tensor
    from the leading rank, as ranks of a host share any load."""

    def __init__(self, hosts: int, leader: bool, settings: Settings) -> None:
        self.leader, self.settings = leader, settings
        on = self.leader_owns_all
        why = "the host's leading rank" if on else "LOADERPLUG_HOST_SPLIT=off"
        self.choice = HostsChoice(hosts, on, why)
        self.error: BaseException | None = None  # a failure before the load began
        self.opener: ExchangeOpener | None = None
        self._exchange: HostExchange | None = None
        self._steps: Steps | None = None
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None  # the rounds' failure
        self._starting = threading.Lock()

    # What the load says of the hosts (HostsSaid).
    @property
    def hosts(self) -> int:
        return self.choice.hosts

    @property
    def split(self) -> bool:
        return self.choice.split

    @property
    def why(self) -> str:
        return self.choice.why

    @property
    def exchanged(self) -> Exchanged | None:
        return self.choice.exchanged

    def describe(self) -> str:
        return self.choice.describe()

    @property
    def leader_owns_all(self) -> bool:
        """Whether the host's leading rank reads every file (every rank of a host
        decides it alike, before any exchange: so also where the hosts then do not
        split, and the leading rank reads alone)."""
        return self.settings.host_split != "off"

    def load_settings(self, settings: Settings) -> Settings:
        """The settings of the load this rank runs: on a leading rank that exchanges,
        spans as the exchange's, into memory of the load's own (a mapped mirror file
        would be read again), by a fixed count of readers (they wait for the exchange,
        which an adaptive count would take for a slow mount), within what the host's
        memory budget leaves once the exchange's reads ahead and feed have theirs."""
        if self.opener is None:
            return settings
        exchange = ahead_bytes(self.settings) + feed_bytes(self.settings)
        return settings.replace(
            bytes_in_flight=max(settings.bytes_in_flight - exchange, EXCHANGE_SPAN),
            span_bytes=self.settings.span_bytes,
            split_threshold_bytes=self.settings.split_threshold_bytes,
            owned="own",
            readers=AUTO_READERS,
        )

    def begin(
        self, files: list[Path], local_dir: str | os.PathLike[str] | None, world: World, group: Any
    ) -> None:
        """Agree with the other hosts' leading ranks on the spans, and start the rounds."""
        local = Path(local_dir) if local_dir is not None else None
        steps = _leaders(world, group, self.settings)
        feed = SpanFeed(budget=feed_bytes(self.settings))
        keep_going = _keep_going(self.settings, self.hosts)
        exchange = HostExchange(files, local, steps, self.settings, feed, keep_going)
        try:
            splitting = exchange.prepare(locked=_not_locked(local))
        except BaseException:
            tear_down(steps, [steps.share.group])
            raise
        self._exchange, self._steps = exchange, steps
        if not splitting:
            tear_down(steps, [steps.share.group])
            self._conclude()
            return
        paths = {str(path): index for index, path in enumerate(exchange.files)}
        opener = Plugins(self.settings).open_source
        self.opener = ExchangeOpener(feed, paths, opener)
        feed.on_first_read = self._start_rounds
        self._thread = threading.Thread(
            target=self._rounds, name="loaderplug-hosts-exchange", daemon=True
        )
        if not feed.expected:  # this host lacks nothing: the others need not wait for it
            self._start_rounds()

    def _start_rounds(self) -> None:
        """The rounds begin once the load reads (or ends, reading nothing of them)."""
        with self._starting:
            if self._thread is not None and self._thread.ident is None:
                self._thread.start()

    def _rounds(self) -> None:
        exchange, steps = self._exchange, self._steps
        assert exchange is not None and steps is not None
        try:
            exchange.rounds()
        except BaseException as exc:
            self._failed = exc
            exchange.feed.fail(exc)
        finally:
            tear_down(steps, [steps.share.group])

    def raised(self, exc: BaseException) -> BaseException:
        """What the load raises for ``exc``: the exchange's own failure (naming the host
        that died, stalled or failed) where it caused it."""
        return self._failed if self._failed is not None else exc

    def finish(self, completed: bool = False) -> None:
        """The load is over (``completed``: every tensor handed over): the rounds end
        (abandoned, if this host's load did not complete), and the choice is told."""
        exchange = self._exchange
        if exchange is None or self._thread is None:
            return
        if not completed:
            exchange.abandoned = True  # the others read the rest alone
        self._start_rounds()  # the other hosts wait for this host's word in each round
        exchange.feed.close()  # nothing more is kept here: the rounds serve the others
        self._join()
        self._thread = None
        self._conclude()

    def _join(self) -> None:
        assert self._thread is not None
        while self._thread.is_alive():
            self._thread.join(0.1)  # a timed join keeps the main thread able to take Ctrl-C

    def _conclude(self) -> None:
        exchange = self._exchange
        assert exchange is not None
        done = exchange.done
        done.mirror_bytes += exchange.feed.read_alone
        split, hosts = exchange.finished, self.hosts
        why = _why(self.settings, done, split, hosts)
        if self._failed is not None:
            why = f"the exchange ended early: {self._failed}"
        self.choice = HostsChoice(hosts, split, why, done)

    def adopt(self, choice: HostsChoice) -> None:
        """What the host's leading rank said the hosts did (on the host's other ranks)."""
        self.choice = choice


class SplitPairs(Iterator[tuple[str, Any]]):
    """The tensors of a leading rank alone on its host: at the end the exchange's rounds
    end too; a failure the exchange caused is raised as the exchange's own."""

    def __init__(self, pairs: Iterator[tuple[str, Any]], split: HostSplit) -> None:
        self._pairs, self._split = pairs, split

    def __next__(self) -> tuple[str, Any]:
        try:
            return next(self._pairs)
        except StopIteration:
            self._split.finish(completed=True)
            raise
        except BaseException as exc:
            self._split.finish()
            cause = self._split.raised(exc)
            if cause is exc:
                raise
            raise cause from exc

    def close(self) -> None:
        close = getattr(self._pairs, "close", None)
        if close is not None:
            close()
        self._split.finish()


def _not_locked(local: Path | None) -> bool:
    """Whether no other job holds ``local``'s folder lock now. Tried, not waited for: a
    host waiting here would keep the others waiting in a collective. A folder another
    job holds (or that two hosts share) is not split."""
    if local is None:
        return True
    lock = Lock(folder_lock(local), 0)
    try:
        lock.acquire()
    except LockError:
        return False
    finally:
        lock.release()
    return True


def _leaders_group(world: World, settings: Settings) -> Any:
    """The hosts' leading ranks' gloo group, on each of them (None on the other ranks):
    every rank of ``world`` says what groups it holds, so the leaders name it alike."""
    import torch.distributed as dist

    leaders = tuple(dist.get_global_rank(world.group, host[0]) for host in world.hosts())
    return agreed_group(leaders, over(world.group), settings.distributed_timeout_s)


def _leaders(world: World, group: Any, settings: Settings) -> Steps:
    """Steps among the hosts' leading ranks, in their gloo ``group``, each host watched
    by its heartbeat (a pidfd cannot see another host)."""
    import torch.distributed as dist

    layout = world.hosts()
    leaders = tuple(dist.get_global_rank(world.group, host[0]) for host in layout)
    names = [world.ranks[host[0]].hostname or f"#{i}" for i, host in enumerate(layout)]
    here = leaders.index(dist.get_rank())
    peers = tuple(Peer(r, None, names[i]) for i, r in enumerate(leaders) if i != here)
    share = Share(
        group,
        here,
        len(leaders),
        leaders,
        settings.distributed_timeout_s,
        peers,
        heartbeat_store(group, world.load_id),
    )
    return Steps(share, watch(share))


def _keep_going(settings: Settings, hosts: int) -> Callable[[Exchanged], bool] | None:
    """Under ``auto``, whether to go on splitting once the rates are measured. Split, the
    model reaches a host at the pace its spans arrived in the measured rounds (read from
    its mount or received, the reads, the gathers and the rounds' lockstep all in it);
    alone, at the pace its mount read while it read. Splitting pays while the first is
    the faster (each the hosts' mean: a split goes at its slowest host's pace, and the
    hosts decide alike). The local disk, and the device, take the same bytes either way."""
    if settings.host_split == "on":
        return None

    def keep_going(done: Exchanged) -> bool:
        mirror, split = _mean_rates(done)
        if mirror is None or split is None:
            return True
        return split > mirror

    return keep_going


def _mean_rates(done: Exchanged) -> tuple[float | None, float | None]:
    mirror = [m for m, _ in done.rates if m]
    exchange = [x for _, x in done.rates if x]
    return (
        statistics.fmean(mirror) if mirror else None,
        statistics.fmean(exchange) if exchange else None,
    )


def _why(settings: Settings, done: Exchanged, split: bool, hosts: int) -> str:
    if done.not_split is not None:
        return f"{done.not_split}: each host read its own mirror"
    mirror, pace = _mean_rates(done)
    if mirror is None or pace is None:
        measured = "too little to measure"
    else:
        measured = (
            f"the model reached each host at {pace / MiB:.0f} MiB/s split, its mirror "
            f"read {mirror / MiB:.0f} MiB/s alone"
        )
    if settings.host_split == "on":
        return f"LOADERPLUG_HOST_SPLIT=on ({measured})"
    if split:
        return f"the split is the faster ({measured})"
    return f"the mirror alone is as fast ({measured}): each host read the rest alone"
