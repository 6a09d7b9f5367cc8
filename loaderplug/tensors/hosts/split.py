"""Ranks on several hosts: the hosts split a one pass's reads of the mirror.

A model served across hosts is loaded by every host, each from its own mount of the
network volume: read alone, the volume serves the model once per host. When a one pass
hydrates a local copy (``local_dir``) and the group's ranks run on two or more hosts,
one rank per host (its lowest) takes part in a :class:`~loaderplug.tensors.hosts.exchange.
HostExchange`: each host reads about 1/H of the spans and receives the rest from the
other hosts, over a gloo group of those ranks (torch.distributed is the transport: the
job's own network, no socket of loaderplug's). Then every host holds a current local
copy, and the load goes on as on one host (its ranks share it as
:mod:`loaderplug.tensors.ranks.shared` says), reading that copy, mostly from the page cache.

Which ranks share a host comes from torchrun's variables where they are set, else from
what each rank sees of its machine (:class:`~loaderplug.tensors.ranks.world.World`).
Whether to split is measured, not configured (``LOADERPLUG_HOST_SPLIT=auto``): the first
rounds time the mirror's reads and the exchange, and the hosts stop splitting (each
reads the rest alone, nothing read twice) unless the exchange is the faster.

While the host's leading rank exchanges, its other ranks wait in steps of the host's
share, which the leader ticks every :data:`TICK_S`, so the collective timeout bounds a
silence, not the hydrate. A host that dies or whose network stalls is noticed by its
heartbeat within seconds (:mod:`loaderplug.tensors.ranks.peers`); every rank of every host
then fails, naming it.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderplug.errors import LockError
from loaderplug.jobs.locks import Lock, folder_lock
from loaderplug.settings import Settings
from loaderplug.tensors.hosts.exchange import EXCHANGE_SPAN, Exchanged, HostExchange
from loaderplug.tensors.ranks.collectives import abandon
from loaderplug.tensors.ranks.groups import agreed_group, over
from loaderplug.tensors.ranks.peers import Peer
from loaderplug.tensors.ranks.steps import Steps
from loaderplug.tensors.ranks.teardown import tear_down
from loaderplug.tensors.ranks.world import Share, World, heartbeat_store, watch
from loaderplug.units import MiB

# How often the leading rank of a host tells its other ranks it is still exchanging.
TICK_S = 5.0


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
        "on": "a one pass on two or more hosts splits the mirror's reads (forced on)",
        "auto": "a one pass on two or more hosts splits the mirror's reads while the "
        "exchange measured in its first rounds beats the mirror; one host: never",
    }[settings.host_split]
    return f"hosts: {known}; {rule}"


def split_across_hosts(
    paths: Sequence[str | os.PathLike[str]],
    local_dir: str | os.PathLike[str] | None,
    world: World | None,
    share: Share | None,
    settings: Settings,
) -> HostsChoice | None:
    """Hydrate ``local_dir`` on every host of ``world`` by a split read (see above);
    None where there is one host or no local copy to hydrate. ``share`` is this host's
    ranks (None: this rank alone here)."""
    if world is None or local_dir is None:
        return None
    layout = world.hosts()
    if len(layout) < 2:
        return None
    # Rank 0's settings on every host: hosts that split differently would part ways.
    mode, span, threshold = world.ranks[0].split
    settings = settings.replace(host_split=mode, split_threshold_bytes=threshold)
    settings = settings.replace(span_bytes=span or EXCHANGE_SPAN)
    if settings.host_split == "off":
        return HostsChoice(len(layout), False, "LOADERPLUG_HOST_SPLIT=off")
    here = next(host for host in layout if world.me in host)
    host_steps = Steps(share, watch(share, "hosts")) if share is not None else None
    try:
        return _split_or_wait(paths, local_dir, world, here, host_steps, settings)
    except BaseException:
        if host_steps is not None and host_steps.pending is not None:
            abandon(host_steps.share.group, host_steps.pending)  # a peer died during it
        raise
    finally:
        if host_steps is not None:
            host_steps.watch.close()


def _split_or_wait(
    paths: Sequence[str | os.PathLike[str]],
    local_dir: str | os.PathLike[str],
    world: World,
    here: list[int],
    host_steps: Steps | None,
    settings: Settings,
) -> HostsChoice:
    """The leading rank's part of the split, told to the host's other ranks; the others
    wait for it."""
    group = _leaders_group(world, host_steps, settings)
    if here[0] != world.me:
        assert host_steps is not None  # a host of more than one rank has a share
        return _wait_for_leader(host_steps)
    files, local = [Path(p) for p in paths], Path(local_dir)
    try:
        choice = _lead(files, local, world, group, settings, _ticker(host_steps))
    except Exception as exc:
        if host_steps is None:
            raise
        host_steps.fail(exc)  # the host's other ranks raise it too, naming this one
    if host_steps is not None:
        host_steps.exchange(("hosts", choice))
    return choice


def _wait_for_leader(steps: Steps) -> HostsChoice:
    """Steps of the host's share until its leading rank says what the hosts did."""
    while True:
        word = steps.exchange(None)[0]
        if word is not None and word[0] == "hosts":
            return word[1]  # type: ignore[no-any-return]


def _ticker(steps: Steps | None) -> Callable[[], None]:
    """A step of the host's share every :data:`TICK_S` (its waiting ranks' heartbeat)."""
    last = time.monotonic()

    def tick() -> None:
        nonlocal last
        if steps is not None and time.monotonic() - last >= TICK_S:
            steps.exchange(("working", None))
            last = time.monotonic()

    return tick


def _leaders_group(world: World, host_steps: Steps | None, settings: Settings) -> Any:
    """The hosts' leading ranks' gloo group, on each of them (None on the other ranks):
    every rank of ``world`` says what groups it holds, so the leaders name it alike. A
    rank that fails here tells its host's other ranks, which raise it too."""
    import torch.distributed as dist

    leaders = tuple(dist.get_global_rank(world.group, host[0]) for host in world.hosts())
    try:
        return agreed_group(leaders, over(world.group), settings.distributed_timeout_s)
    except Exception as exc:
        if host_steps is None:
            raise
        host_steps.fail(exc)


def _lead(
    files: list[Path],
    local: Path,
    world: World,
    group: Any,
    settings: Settings,
    tick: Callable[[], None],
) -> HostsChoice:
    """This host's part of the exchange, among the hosts' leading ranks, in their
    ``group``."""
    layout = world.hosts()
    steps = _leaders(world, group, settings)
    # Tried, not waited for: a host waiting here would keep the others waiting in a
    # collective. A folder another job holds (or that two hosts share) is not split.
    lock = Lock(folder_lock(local), 0)
    try:
        exchange = HostExchange(
            files, local, steps, settings, tick, _keep_going(settings, len(layout))
        )
        with contextlib.suppress(LockError):
            lock.acquire()
        done = exchange.run(locked=lock.held)
    finally:
        lock.release()
        tear_down(steps, [steps.share.group])
    split = exchange.finished
    return HostsChoice(len(layout), split, _why(settings, done, split, len(layout)), done)


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
    """Under ``auto``, whether to go on splitting once the rates are measured. Split, a
    host reads 1/H of the model from its mirror and receives (H-1)/H over the exchange,
    side by side; alone, it reads all of it: splitting pays while the exchange, carrying
    its (H-1)/H, beats the mirror carrying all (rates as the hosts' mean: bytes a host
    receives, or reads, per second)."""
    if settings.host_split == "on":
        return None

    def keep_going(done: Exchanged) -> bool:
        mirror, exchange = _mean_rates(done)
        if mirror is None or exchange is None:
            return True
        return exchange * hosts / (hosts - 1) > mirror

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
    mirror, exchange = _mean_rates(done)
    if mirror is None or exchange is None:
        measured = "too little to measure"
    else:
        measured = (
            f"exchange {exchange / MiB:.0f} MiB/s for {hosts - 1}/{hosts} of the model, "
            f"mirror {mirror / MiB:.0f} MiB/s for all of it, per host"
        )
    if settings.host_split == "on":
        return f"LOADERPLUG_HOST_SPLIT=on ({measured})"
    if split:
        return f"the exchange beats the mirror ({measured})"
    return f"the mirror is as fast as the exchange ({measured}): each host read the rest alone"
