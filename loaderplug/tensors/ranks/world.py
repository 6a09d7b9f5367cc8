"""Which ranks share a load: where every rank of the group runs (:class:`World`), those
of this host in a gloo group of loaderplug's own, and the processes among them this
rank can watch."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderplug.settings import Settings
from loaderplug.tensors.ranks.collectives import collective
from loaderplug.tensors.ranks.groups import agreed_group, over
from loaderplug.tensors.ranks.peers import Heartbeats, Peer, PeerWatch, pid_namespace


@dataclass(frozen=True)
class Share:
    """This host's ranks of a group: a gloo group of loaderplug's own, this rank in it."""

    group: Any  # torch.distributed.ProcessGroup
    rank: int
    size: int
    global_ranks: tuple[int, ...]  # each member's rank in the default group
    timeout_s: int
    peers: tuple[Peer, ...] = ()  # the other members, to watch
    # A store under a prefix of this load's own (:func:`heartbeat_store`), where some
    # member is in another pid namespace.
    heartbeats: Any = None


@dataclass(frozen=True)
class World:
    """Where every rank of a group runs, as gathered once at the start of a load."""

    group: Any  # torch.distributed.ProcessGroup
    ranks: tuple[RankProcess, ...]  # by rank in ``group``
    me: int  # this rank in ``group``

    @property
    def load_id(self) -> str:
        """This load's own name, the same on every rank: rank 0's draw, as every rank
        gathered it (see :attr:`RankProcess.draw`)."""
        return self.ranks[0].draw

    def hosts(self) -> list[list[int]]:
        """The group's ranks by host, hosts in the order of their first rank."""
        by_host: dict[str, list[int]] = {}
        for rank, process in enumerate(self.ranks):
            by_host.setdefault(process.host, []).append(rank)
        return list(by_host.values())


def world_of(
    group: Any, settings: Settings, local_dir: str | os.PathLike[str] | None = None
) -> World | None:
    """Where the ranks of ``group`` (None: the initialised default group) run, or None
    to load alone: sharing is off, or there is no group of more than one rank."""
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
    collective(dist.all_gather_object, ranks, RankProcess.here(settings, local_dir), group=group)
    return World(group, tuple(ranks), dist.get_rank(group))


def share_for(world: World | None, settings: Settings) -> Share | None:
    """The ranks on this host that share a load with this one, or None to load alone
    (no ``world``, or it has one rank here). Ranks share a host when they share its
    filesystems (see :func:`host_id`). Every rank of ``world`` calls this: they all say
    what groups each holds, so that each host's group is named alike on its members."""
    if world is None:
        return None
    import torch.distributed as dist

    group, ranks, me_here = world.group, world.ranks, world.ranks[world.me]
    layout = world.hosts()
    if all(len(host) <= 1 for host in layout):
        return None  # so every rank, alike: no host makes a group, nothing to gather
    here = next(host for host in layout if world.me in host)
    members = tuple(dist.get_global_rank(group, r) for r in here)
    # Every rank of the group takes part in the gather; only this host's ranks make
    # their group (every host makes its own), and a rank alone here makes none.
    own = agreed_group(
        members if len(members) > 1 else (), over(group), settings.distributed_timeout_s
    )
    if own is None:
        return None
    peers = tuple(
        Peer(dist.get_global_rank(group, r), ranks[r].pid if _visible(me_here, ranks[r]) else None)
        for r in here
        if r != world.me
    )
    me = members.index(dist.get_rank())
    beats = heartbeat_store(own, world.load_id) if any(p.pid is None for p in peers) else None
    return Share(own, me, len(members), members, settings.distributed_timeout_s, peers, beats)


def watch(share: Share, what: str = "load") -> PeerWatch:
    """A watch on the share's other ranks: their processes, or their heartbeats, kept
    under ``what`` the watch is for (every member watches a share for the same things,
    in the same order). Two watches of one share, as a split between hosts and then the
    load have, each have keys of their own: the last one out of the first removes its
    keys while the second may already beat."""
    if share.heartbeats is None:
        return PeerWatch(share.peers)
    import torch.distributed as dist

    store = dist.distributed_c10d.PrefixStore(f"{what}/", share.heartbeats)
    return PeerWatch(share.peers, Heartbeats(store, share.global_ranks[share.rank], share.peers))


def _visible(me: RankProcess, other: RankProcess) -> bool:
    """Whether ``other``'s process id means the same process to this rank."""
    return me.pid_namespace is not None and other.pid_namespace == me.pid_namespace


def heartbeat_store(group: Any, load_id: str) -> Any:
    """Where the share's ranks keep their heartbeats: the default group's store, under a
    prefix of this load's and this group's own (None where torch does not say what the
    store is). The group's name alone would not do: the next load's group, of the same
    ranks, bears the same name, and would read what this load left (a death named, a
    count that stood still)."""
    import torch.distributed as dist

    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if default_store is None:
        return None
    return dist.distributed_c10d.PrefixStore(
        f"loaderplug/heartbeats/{load_id}/{group.group_name}/", default_store()
    )


@dataclass(frozen=True)
class RankProcess:
    """Where a rank runs: its host, and its process as the host's other ranks see it."""

    host: str
    pid: int
    pid_namespace: str | None
    hostname: str = ""  # the host's name, for messages
    # The settings the hosts' split must agree on (rank 0's are used): LOADERPLUG_HOST_SPLIT,
    # LOADERPLUG_SPAN_BYTES (0: unset) and LOADERPLUG_SPLIT_THRESHOLD_BYTES.
    split: tuple[str, int, int] = ("auto", 0, 0)
    # A random name for the load, drawn by every rank and gathered with the rest, of
    # which rank 0's is the load's (World.load_id): the ranks agree on it in the
    # collective that starts every shared load, so it costs none of its own. Drawn,
    # not counted: a count of each process's loads would be the same on every rank only
    # while every rank made the same loads and failed at the same points, and a name
    # that differs between ranks would have each watch keys nobody beats, blind to any
    # death; a draw never repeats, in this process or in any other using the store.
    draw: str = ""

    @staticmethod
    def here(settings: Settings, local_dir: str | os.PathLike[str] | None = None) -> RankProcess:
        host = settings.host_id or torchrun_host(local_dir) or host_id(local_dir)
        split = (settings.host_split, settings.span_bytes or 0, settings.split_threshold_bytes)
        return RankProcess(
            host,
            os.getpid(),
            pid_namespace(),
            socket.gethostname(),
            split,
            secrets.token_hex(8),
        )


def torchrun_host(local_dir: str | os.PathLike[str] | None = None) -> str | None:
    """The host torchrun says this rank runs on (its node, ``GROUP_RANK``, when torchrun
    set ``LOCAL_WORLD_SIZE`` too), with the local folder as :func:`host_id` has it:
    ranks of one node with different local folders do not share a copy. None elsewhere."""
    node = os.environ.get("GROUP_RANK")
    if node is None or os.environ.get("LOCAL_WORLD_SIZE") is None:
        return None
    return f"torchrun-node-{node}/{_folder_identity(local_dir)}"


def host_id(local_dir: str | os.PathLike[str] | None = None) -> str:
    """What tells hosts apart: the host name and this boot of it, and what this process
    sees of the filesystems. Containers with the host's network share its name and boot
    but not its files: their mount namespaces differ, and so may the local folder that
    carries the same name in each (its device and inode)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}/{_mount_namespace()}/{_folder_identity(local_dir)}"


def _mount_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/mnt")
    except OSError:
        return ""


def _folder_identity(local_dir: str | os.PathLike[str] | None) -> str:
    """The local folder's device and inode. It is made first (a one pass would make it),
    so that ranks looking at once all see it; where it cannot be, the nearest folder
    above it that exists, and the rest of the path."""
    if local_dir is None:
        return ""
    folder = Path(local_dir).absolute()
    with contextlib.suppress(OSError):  # the load itself says what is wrong with it
        folder.mkdir(parents=True, exist_ok=True)
    for existing in (folder, *folder.parents):
        try:
            stat = os.stat(existing)
        except OSError:
            continue
        return f"{stat.st_dev}:{stat.st_ino}:{folder.relative_to(existing)}"
    return ""
