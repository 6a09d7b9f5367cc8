"""Ranks that share a load: each byte read once per host, every tensor to every rank.

When the ranks of a ``torch.distributed`` group load the same files (tensor-parallel
workers on one host), each reading everything would read the model once per rank, from
the disk or the volume, and hold it once per rank. Instead the ranks of each host
(:mod:`~loaderplug.tensors.ranks.world`) split the files between them, balanced by bytes,
by a rule every rank computes the same way (:mod:`~loaderplug.tensors.ranks.mode`). Each
rank loads its own files as any load is loaded (a plan run by the runner: locks,
leftovers, current copies, the memory budget), and the tensors reach the other ranks
one of three ways (a module each, ``rank_pagecache``, ``rank_stream``,
``rank_broadcast``):

* **pagecache** (CPU tensors from files on a local filesystem): the owner reads buffered,
  so once it is done with a file the file sits in the page cache; it says so, and the
  others map it from there, as safetensors does, without reading the disk again. A
  file read in place is the owner's mapping too (its engine reads into reused buffers
  and each tensor is handed over as a view of the page cache once landed): the host
  holds the model once, in the page cache. A one pass publishes each rank's files into
  the local copy, and the others map that; the owner maps the copy it is writing.
* **stream** (a one pass from a network mirror): the owner names each tensor as it
  lands in the copy it writes through the page cache, and the others map the copy and
  take it from there; the copy's pages leave the page cache as every rank is done
  with them.
* **broadcast** (CUDA tensors over NCCL, or files on a network filesystem, whose pages
  no other process can share): the owner broadcasts each tensor over the group as it
  completes.

The ranks advance in steps, all together: at each step every rank says (through one
small collective) what it has done since the last one: a file finished, a tensor to
broadcast, the tensors that landed (or none yet), nothing left, or the error it hit. An
error on one rank is raised on every rank, naming the rank
(:mod:`~loaderplug.tensors.ranks.steps`); every collective runs on a
group of loaderplug's own with ``LOADERPLUG_DISTRIBUTED_TIMEOUT_S``, the bound for a
rank that is slow. A rank that dies is noticed at once (:mod:`loaderplug.tensors.ranks.peers`
watches the processes of the host's ranks): every other rank stops reading and raises,
naming it, whether it was waiting in a step, reading, or waiting for its consumer to ask
for the next tensor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from loaderplug.engine.buffers import Opener
from loaderplug.errors import LoaderplugError
from loaderplug.jobs.runner import Runner
from loaderplug.settings import Settings
from loaderplug.tensors.delivery.choice import TensorDelivery
from loaderplug.tensors.delivery.load import Load
from loaderplug.tensors.delivery.plan import load_plan
from loaderplug.tensors.device.path import DevicePath
from loaderplug.tensors.ranks.agreement import agreed_mode, same_files
from loaderplug.tensors.ranks.batches import STREAM_BATCH, LandedBatches
from loaderplug.tensors.ranks.broadcast import by_broadcast, data_group
from loaderplug.tensors.ranks.files import FileKey, LoadPath, by_name, load_paths, object_key
from loaderplug.tensors.ranks.mode import SharingMode, owners, rank_part, sharing_mode
from loaderplug.tensors.ranks.pagecache import by_page_cache
from loaderplug.tensors.ranks.steps import SharedPairs, Steps
from loaderplug.tensors.ranks.stream import by_stream
from loaderplug.tensors.ranks.teardown import free_groups, tear_down
from loaderplug.tensors.ranks.world import Share, World, share_for, watch, world_of

__all__ = [
    "STREAM_BATCH",
    "LandedBatches",
    "Share",
    "World",
    "owners",
    "rank_part",
    "share_for",
    "shared_tensors",
    "sharing_mode",
    "world_of",
]


class HostPart(Protocol):
    """A rank's part in a load split across hosts
    (:class:`loaderplug.tensors.hosts.split.HostSplit`, made a layer above)."""

    error: BaseException | None  # a failure before the load: raised on every rank here

    @property
    def opener(self) -> Opener | None: ...  # on a leading rank that exchanges: its reads
    @property
    def leader_owns_all(self) -> bool: ...
    @property
    def choice(self) -> Any: ...
    def finish(self, completed: bool = False) -> None: ...
    def adopt(self, choice: Any) -> None: ...


def shared_tensors(
    paths: Sequence[str | os.PathLike[str]],
    device: DevicePath,
    local_dir: str | os.PathLike[str] | None,
    settings: Settings,
    share: Share,
    load: Load,
    split: HostPart | None = None,
) -> SharedLoad:
    """Every tensor of ``paths`` on this rank, this rank reading only its own files;
    ``load`` gets the record of what this rank did. With ``split`` (ranks on several
    hosts that split the reads) the host's leading rank reads every file, through the
    hosts' exchange, and the others get its tensors."""
    pairs = _shared_pairs(paths, device, local_dir, settings, share, load, split)
    return SharedLoad(pairs, share)


class SharedLoad(Iterator[tuple[str, Any]]):
    """A shared load's tensors; closed (or dropped) before its first, it frees the
    share's group, which only a started load's own cleanup would."""

    def __init__(self, pairs: SharedPairs, share: Share) -> None:
        self._pairs: SharedPairs | None = pairs
        self._share = share
        self._started = False

    def __next__(self) -> tuple[str, Any]:
        if self._pairs is None:
            raise StopIteration
        self._started = True
        return next(self._pairs)

    def close(self) -> None:
        pairs, self._pairs = self._pairs, None
        if pairs is None:
            return
        pairs.close()
        if not self._started:
            free_groups([self._share.group])

    def __del__(self) -> None:
        self.close()


def _shared_pairs(
    paths: Sequence[str | os.PathLike[str]],
    device: DevicePath,
    local_dir: str | os.PathLike[str] | None,
    settings: Settings,
    share: Share,
    load: Load,
    split: HostPart | None,
) -> SharedPairs:
    files = by_name(load_paths(paths))  # who owns which file: the same on every rank
    local = Path(local_dir) if local_dir is not None else None
    # LOADERPLUG_BYTES_IN_FLIGHT bounds the host: the ranks sharing its load divide it.
    # (Where the hosts split the reads, the host's leading rank reads every file: its
    # budget is the host's, less what its exchange holds.)
    if split is None or not split.leader_owns_all:
        settings = settings.replace(bytes_in_flight=rank_part(settings.bytes_in_flight, share.size))
    steps = Steps(share, watch(share))
    groups = [share.group]
    try:
        if split is not None and split.error is not None:
            steps.fail(split.error)  # at the step the host's other ranks take first
        keys = same_files(steps, files)  # the files each rank loads, the same on all
        owner = _owners(files, steps, split)
        mine = [f for f, r in zip(files, owner, strict=True) if r == share.rank]
        mode = agreed_mode(steps, _mode(files, device, local, settings, split))
        if mode in ("pagecache", "stream"):
            # Buffered, so what this rank reads (and writes) stays in the page cache for
            # the others to map; this rank maps it too (the file read in place, or the
            # copy a one pass writes), so the host holds it once.
            settings = settings.replace(direct_io="off")
        opener = split.opener if split is not None else None
        runner, delivery = _own_load(mine, device, settings, local, mode, steps, opener)
        if mode == "broadcast":
            groups.append(data_group(steps, device))
        pairs = _pairs(mode, runner, delivery, steps, files, keys, local, device, groups[-1])
        handed = FirstHandedOver(pairs)
        yield from handed
        if split is not None:
            _tell_the_host(steps, split)
    finally:
        tear_down(steps, groups)
    load.report, load.io_modes = runner.report, runner.io_modes
    # When this rank's consumer had its first tensor (its own first tensor may have
    # landed earlier and waited for a step), from the job's start as in any load.
    load.first_tensor_s = (
        handed.at - delivery.started
        if handed.at is not None and delivery.started is not None
        else delivery.first_tensor_s
    )
    load.sharing, load.bytes_in_flight = mode, settings.bytes_in_flight
    load.record_device(device)
    load.owners = {str(f): share.global_ranks[r] for f, r in zip(files, owner, strict=True)}


def _own_load(
    mine: list[LoadPath],
    device: DevicePath,
    settings: Settings,
    local: Path | None,
    mode: SharingMode,
    steps: Steps,
    opener: Opener | None = None,
) -> tuple[Runner, TensorDelivery]:
    """The load of this rank's own files, stopped by a peer's death (``opener``: what
    its engine reads through, the hosts' exchange on a host's leading rank)."""
    plan = load_plan(
        mine,
        device,
        settings,
        local,
        lock_each_file=True,
        through_page_cache=mode in ("pagecache", "stream"),
        shared_by_ranks=True,
        open_source=opener,
    )
    delivery = plan.delivery
    assert isinstance(delivery, TensorDelivery)
    # A dead peer stops this rank's reading and wakes its wait for the next tensor.
    steps.watch.on_death(lambda peer: delivery.interrupt(steps.watch.error(peer)))
    return Runner(plan, settings), delivery


def _pairs(
    mode: SharingMode,
    runner: Runner,
    delivery: TensorDelivery,
    steps: Steps,
    load_files: list[LoadPath],
    agreed: list[FileKey],
    local: Path | None,
    device: DevicePath,
    group: Any,
) -> SharedPairs:
    """Every tensor of the load on this rank, shared as ``mode`` says (``agreed``: the
    files as the ranks agreed on them)."""
    if mode == "broadcast":
        return by_broadcast(runner, steps, device, group)
    # Only files are mapped (see _mode): objects are broadcast.
    files = [f for f in load_files if isinstance(f, Path)]
    assert len(files) == len(load_files)
    if mode == "pagecache":
        if local is None:
            return by_page_cache(runner, steps, files, files, device, agreed)
        final = [local / f.name for f in files]
        return by_page_cache(runner, steps, files, final, device, None)
    return by_stream(runner, steps, files, agreed, local, delivery, device)


def _owners(files: list[LoadPath], steps: Steps, split: HostPart | None) -> list[int]:
    """Which rank of the host reads each file: balanced by bytes, or, where the hosts
    split the reads, the host's leading rank every one (its load reads the exchange)."""
    if split is not None and split.leader_owns_all:
        return [0] * len(files)
    return owners(_sizes(files, steps), steps.share.size)


def _mode(
    files: list[LoadPath],
    device: DevicePath,
    local: Path | None,
    settings: Settings,
    split: HostPart | None,
) -> SharingMode:
    """How the tensors reach the host's other ranks: streaming with the hosts splitting
    the reads, by broadcast (mapping the mirror's file would read it again); objects in
    a store, by broadcast (nothing to map)."""
    if split is not None and split.leader_owns_all and local is None:
        return "broadcast"
    paths = [f for f in files if isinstance(f, Path)]
    if len(paths) < len(files):
        return "broadcast"
    return sharing_mode(paths, device.device, local, settings)


def _tell_the_host(steps: Steps, split: HostPart) -> None:
    """Past the last tensor: the leading rank ends its exchange and tells the host's
    other ranks what the hosts did."""
    if steps.share.rank == 0:
        split.finish(completed=True)
    said = steps.exchange(("hosts", split.choice) if steps.share.rank == 0 else None)
    if steps.share.rank != 0 and said[0] is not None:
        split.adopt(said[0][1])


def _sizes(files: list[LoadPath], steps: Steps) -> list[int]:
    """Each file's size; a file that cannot be looked at fails the load on every rank."""
    try:
        return [_size(p) for p in files]
    except LoaderplugError as exc:  # the others hear of it at their first step
        steps.fail(exc)


def _size(path: LoadPath) -> int:
    if isinstance(path, str):
        return int(object_key(path)[0])
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise LoaderplugError(f"{path}: cannot read it: {exc.strerror or exc}") from exc


class FirstHandedOver(Iterator[tuple[str, Any]]):
    """``pairs``, noting when the first is handed over. An iterator object, not a
    generator: it keeps no tensor, and ``yield from`` closes ``pairs`` through it."""

    def __init__(self, pairs: SharedPairs) -> None:
        self._pairs = pairs
        self.at: float | None = None  # time.monotonic() of the first pair

    def __next__(self) -> tuple[str, Any]:
        pair = next(self._pairs)
        if self.at is None:
            self.at = time.monotonic()
        return pair

    def throw(self, *exc: Any) -> tuple[str, Any]:
        # As ``yield from`` would with ``pairs`` itself: its cleanup runs first.
        return self._pairs.throw(*exc)

    def close(self) -> None:
        self._pairs.close()
