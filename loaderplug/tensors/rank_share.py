"""Which ranks share a load: those of the group on this host, in a gloo group of
loaderplug's own, and the processes among them this rank can watch."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

from loaderplug.settings import Settings
from loaderplug.tensors.peers import Peer, pid_namespace
from loaderplug.tensors.rank_collectives import collective


@dataclass(frozen=True)
class Share:
    """This host's ranks of a group: a gloo group of loaderplug's own, this rank in it."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    size: int
    global_ranks: tuple[int, ...]  # each member's rank in the default group
    timeout_s: int
    peers: tuple[Peer, ...] = ()  # the other members whose processes this one can watch


def share_for(group: Any, settings: Settings) -> Share | None:
    """The ranks on this host that share a load with this one, or None to load alone:
    sharing is off, no group is given or initialised, or it has one rank here."""
    if settings.distributed == "off":
        return None
    import torch.distributed as dist

    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = dist.group.WORLD
    size = dist.get_world_size(group)
    if size <= 1:
        return None
    ranks: list[Any] = [None] * size
    collective(dist.all_gather_object, ranks, RankProcess.here(settings), group=group)
    me_here = ranks[dist.get_rank(group)]
    here = [r for r, rank in enumerate(ranks) if rank.host == me_here.host]
    members = tuple(dist.get_global_rank(group, r) for r in here)
    if len(members) <= 1:
        return None
    peers = tuple(
        Peer(dist.get_global_rank(group, r), ranks[r].pid)
        for r in here
        if ranks[r] != me_here
        and me_here.pid_namespace is not None
        and ranks[r].pid_namespace == me_here.pid_namespace
    )
    timeout = datetime.timedelta(seconds=settings.distributed_timeout_s)
    # Only this host's ranks take part in making their group (every host makes its own).
    own = dist.new_group(
        list(members), timeout=timeout, backend="gloo", use_local_synchronization=True
    )
    me = members.index(dist.get_rank())
    return Share(own, me, len(members), members, settings.distributed_timeout_s, peers)


@dataclass(frozen=True)
class RankProcess:
    """Where a rank runs: its host, and its process as the host's other ranks see it."""

    host: str
    pid: int
    pid_namespace: str | None

    @staticmethod
    def here(settings: Settings) -> RankProcess:
        return RankProcess(settings.host_id or host_id(), os.getpid(), pid_namespace())


def host_id() -> str:
    """What tells hosts apart: the host name and this boot of it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
