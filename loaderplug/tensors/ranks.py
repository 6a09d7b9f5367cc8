"""Ranks that share a load: each byte read once per host, every tensor to every rank.

When the ranks of a ``torch.distributed`` group load the same files (tensor-parallel
workers on one host), each reading everything would read the model once per rank, from
the disk or the volume, and hold it once per rank. Instead the ranks of each host
(:func:`share_for`) split the files between them, balanced by bytes, by a rule every rank
computes the same way (:func:`owners`). Each rank loads its own files as any load is
loaded (a plan run by the runner: locks, leftovers, current copies, the memory budget),
and the tensors reach the other ranks one of three ways:

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
error on one rank is raised on every rank, naming the rank; every collective runs on a
group of loaderplug's own with ``LOADERPLUG_DISTRIBUTED_TIMEOUT_S``, the bound for a
rank that is slow. A rank that dies is noticed at once (:mod:`loaderplug.tensors.peers`
watches the processes of the host's ranks): every other rank stops reading and raises,
naming it, whether it was waiting in a step, reading, or waiting for its consumer to ask
for the next tensor.
"""

from __future__ import annotations

import collections
import datetime
import os
import pickle
import socket
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from loaderplug.errors import DistributedError, LoaderplugError
from loaderplug.jobs.current_copy import is_current_copy
from loaderplug.jobs.partial import open_copy
from loaderplug.jobs.runner import Runner
from loaderplug.settings import BY_FIELD, Settings
from loaderplug.storage.mounts import filesystem_type, is_network_type
from loaderplug.tensors.copy_pages import ConsumedPages
from loaderplug.tensors.delivery import (
    FileFinished,
    Idle,
    TensorDelivery,
    TensorReady,
    TensorsOf,
    raise_if_failed,
)
from loaderplug.tensors.device_path import DevicePath
from loaderplug.tensors.header import Header
from loaderplug.tensors.header_reads import read_header_of
from loaderplug.tensors.load import Load
from loaderplug.tensors.load_plan import load_plan
from loaderplug.tensors.peers import Peer, PeerWatch, pid_namespace
from loaderplug.tensors.sinks import MappedFile, MappedTensors
from loaderplug.types import Identity


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
    _collective(dist.all_gather_object, ranks, _RankProcess.here(settings), group=group)
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
class _RankProcess:
    """Where a rank runs: its host, and its process as the host's other ranks see it."""

    host: str
    pid: int
    pid_namespace: str | None

    @staticmethod
    def here(settings: Settings) -> _RankProcess:
        return _RankProcess(settings.host_id or _host_id(), os.getpid(), pid_namespace())


def _host_id() -> str:
    """What tells hosts apart: the host name and this boot of it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank that reads each file: largest files first, each to the rank with the
    fewest bytes so far (ties: the lower rank). The same on every rank."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += sizes[index]
    return owner


def rank_part(host_bytes_in_flight: int, ranks: int) -> int:
    """One rank's part of the host's bytes in flight (never below the setting's floor)."""
    return max(host_bytes_in_flight // ranks, BY_FIELD["bytes_in_flight"].minimum or 1)


def sharing_mode(
    paths: Sequence[Path], device: str, local_dir: Path | None, settings: Settings
) -> Literal["pagecache", "broadcast", "stream"]:
    """How tensors reach the other ranks: as the setting says, or (auto) as measured
    best (benchmarks/scale_bench.py, 3.8 GiB, the last two full runs of 2026-12-04):
    for CPU tensors, the page cache where the bytes are on a local filesystem, the
    stream for a one pass from a network mirror. Read in place: 0.42-0.47x safe_open's
    time per rank at 2 ranks, 0.60-0.67x at 4 (the broadcast 0.90-1.12x and
    2.09-2.39x). A one pass from the mirror: the stream 0.98x a plain hydrate at 2 and
    at 4 ranks in both runs, for the least CPU (0.7-1.0 s per GiB of the model at 2
    ranks; the broadcast 1.7-2.0, the page cache 2.3-2.7); the broadcast 1.01-1.16x at
    2 ranks and 1.74-1.84x at 4 (each rank receives (N-1)/N of the model through a
    socket); the page cache 1.05-1.29x (it waits for whole files, and holds the whole
    copy in memory). A broadcast otherwise: for CUDA tensors, and for network files
    read in place, whose pages another process's mapping would read again from the
    network. Ranks may see a local copy change between their looks:
    :func:`shared_tensors` makes them agree."""
    if settings.rank_sharing != "auto":
        return settings.rank_sharing
    if device != "cpu":
        return "broadcast"
    folders = {local_dir} if local_dir is not None else {p.parent for p in paths}
    if any(is_network_type(filesystem_type(folder)) for folder in folders):
        return "broadcast"
    if local_dir is not None and _copies_from_network(paths, local_dir):
        return "stream"
    return "pagecache"


def _copies_from_network(paths: Sequence[Path], local_dir: Path) -> bool:
    """Whether a one pass into ``local_dir`` reads some file from a network filesystem:
    one whose copy there is not current (a current copy is read instead)."""
    folders = {path.parent for path in paths}
    on_network = {folder for folder in folders if is_network_type(filesystem_type(folder))}
    for path in paths:
        if path.parent not in on_network:
            continue
        try:
            identity = Identity.of(os.stat(path))
        except OSError:
            return True  # the load itself says what is wrong with it
        if not is_current_copy(local_dir / path.name, identity):
            return True
    return False


def shared_tensors(
    paths: Sequence[str | os.PathLike[str]],
    device: DevicePath,
    local_dir: str | os.PathLike[str] | None,
    settings: Settings,
    share: Share,
    load: Load,
) -> Iterator[tuple[str, Any]]:
    """Every tensor of ``paths`` on this rank, this rank reading only its own files;
    ``load`` gets the record of what this rank did."""
    import torch.distributed as dist

    files = [Path(p) for p in paths]
    local = Path(local_dir) if local_dir is not None else None
    # LOADERPLUG_BYTES_IN_FLIGHT bounds the host: the ranks sharing its load divide it.
    settings = settings.replace(bytes_in_flight=rank_part(settings.bytes_in_flight, share.size))
    steps = _Steps(share, PeerWatch(share.peers))
    groups = [share.group]
    try:
        try:
            sizes = [_size(p) for p in files]
        except LoaderplugError as exc:  # the others hear of it at their first step
            steps.exchange(("error", str(exc)))
            raise AssertionError("unreachable: the step raised") from exc
        owner = owners(sizes, share.size)
        mine = [f for f, r in zip(files, owner, strict=True) if r == share.rank]
        mode = _agreed(steps, sharing_mode(files, device.device, local, settings))
        in_page_cache = mode in ("pagecache", "stream")
        if in_page_cache:
            # Buffered, so what this rank reads (and writes) stays in the page cache for
            # the others to map; this rank maps it too (the file read in place, or the
            # copy a one pass writes), so the host holds it once.
            settings = settings.replace(direct_io="off")
        plan = load_plan(
            mine,
            device,
            settings,
            local,
            lock_each_file=True,
            through_page_cache=in_page_cache,
        )
        runner = Runner(plan, settings)
        delivery = plan.delivery
        assert isinstance(delivery, TensorDelivery)
        # A dead peer stops this rank's reading and wakes its wait for the next tensor.
        steps.watch.on_death(lambda peer: delivery.interrupt(steps.watch.error(peer)))
        if mode == "pagecache":
            final = [local / f.name if local is not None else f for f in files]
            pairs = _by_page_cache(runner, steps, files, final, device)
        elif mode == "stream":
            pairs = _by_stream(runner, steps, files, local, delivery, device)
        else:
            groups.append(_data_group(share, device))
            pairs = _by_broadcast(runner, steps, device, groups[-1])
        handed = _FirstHandedOver(pairs)
        yield from handed
    finally:
        # Past the last exchange (or failed everywhere): the peers may exit as they like.
        steps.watch.close()
        # The groups are this load's: left behind, their threads abort the process at
        # exit.
        for group in {id(g): g for g in groups}.values():
            dist.destroy_process_group(group)
            if steps.pending is not None:
                _abandon(group, steps.pending)
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


# A sharing mode's hand-over: every tensor of the load, on this rank.
SharedPairs = Generator[tuple[str, Any], None, None]


class _FirstHandedOver(Iterator[tuple[str, Any]]):
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


def _agreed(
    steps: _Steps, mode: Literal["pagecache", "broadcast", "stream"]
) -> Literal["pagecache", "broadcast", "stream"]:
    """Rank 0's sharing mode, on every rank: a local copy published between two ranks'
    looks at it would have them share in different ways."""
    first = steps.exchange(("mode", mode))[0]
    assert first is not None and first[0] == "mode"
    return first[1]  # type: ignore[no-any-return]


def _data_group(share: Share, device: DevicePath) -> Any:
    """The group tensors are broadcast over: the share's own (gloo) for host tensors, a
    group of the same ranks on the device's collective backend for device ones (NCCL
    for CUDA, from the reader's device copy)."""
    if device.collective == "gloo":
        return share.group
    import torch.distributed as dist

    return dist.new_group(
        list(share.global_ranks),
        timeout=datetime.timedelta(seconds=share.timeout_s),
        backend=device.collective,
        use_local_synchronization=True,
    )


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError as exc:
        raise LoaderplugError(f"{path}: cannot read it: {exc.strerror or exc}") from exc


# -- pagecache -------------------------------------------------------------------------


def _by_page_cache(
    runner: Runner, steps: _Steps, files: list[Path], final: list[Path], device: DevicePath
) -> SharedPairs:
    """Own tensors as they complete; at each own file done, a step: the files the other
    ranks finished meanwhile are mapped from the page cache and yielded."""
    index = {f.name: i for i, f in enumerate(files)}
    events = runner.run()
    try:
        yield from _page_cache_steps(events, steps, index, final, device)
    finally:
        events.close()  # stopped early, or another rank failed: stop reading


def _page_cache_steps(
    events: Iterator[Any],
    steps: _Steps,
    index: dict[str, int],
    final: list[Path],
    device: DevicePath,
) -> Iterator[tuple[str, Any]]:
    own = TensorsOf(events, pause_at_files=True)
    while True:
        news: tuple[str, Any] | None = None
        if not own.done:
            try:
                yield from own  # up to this rank's next file done
            except LoaderplugError as exc:
                news, own.done = ("error", str(exc)), True
            else:
                result = own.finished
                if result is not None and result.status == "failed":
                    news = ("error", f"{result.path}: {result.reason}")
                elif result is not None:
                    news = ("file", index[result.path])
        said = steps.exchange(news)
        for rank, step in enumerate(said):
            if rank != steps.share.rank and step is not None and step[0] == "file":
                yield from _OnDevice(MappedTensors(read_header_of(final[step[1]])), device)
        if all(step is None for step in said):
            return


class _OnDevice(Iterator[tuple[str, Any]]):
    """``pairs`` (mapped CPU tensors) on ``device``. An iterator object: it keeps no
    reference to a tensor it handed over."""

    def __init__(self, pairs: Iterator[tuple[str, Any]], device: DevicePath) -> None:
        self._pairs, self._device = pairs, device

    def __next__(self) -> tuple[str, Any]:
        name, tensor = next(self._pairs)
        # Each rank copies from the one page cache to its own device.
        return name, self._device.to_device(tensor)


# -- broadcast -------------------------------------------------------------------------


def _by_broadcast(
    runner: Runner, steps: _Steps, device: DevicePath, data_group: Any
) -> SharedPairs:
    """A step per tensor: each rank offers its next own tensor, and every offered tensor
    is broadcast from its owner to the others over ``data_group``."""
    events = runner.run()
    try:
        yield from _each_step(
            TensorsOf(events), lambda: _BroadcastStep(steps, device, data_group), steps
        )
    finally:
        events.close()


def _each_step(
    own: Iterator[Any], new_step: Callable[[], _Step], steps: _Steps
) -> Iterator[tuple[str, Any]]:
    """Steps until every rank is done: at each, every rank offers its next own tensor
    (``step.offer()``; a stream's rank may say it has none yet) and hands over every
    tensor offered (``step.hand_over(said)``).
    An error, this rank's own or one it met handing over, ends the load on every rank."""
    done = False
    while True:
        step = new_step()
        error: tuple[str, Any] | None = None
        if not done:
            try:
                step.own = next(own, None)
            except LoaderplugError as exc:
                error, done = ("error", str(exc)), True
            else:
                done = step.own is None
        said = steps.exchange(error or step.offer())
        yield from step.hand_over(said)
        if step.error is not None:  # the others hear of it at once, and all raise
            steps.exchange(("error", step.error))
        if all(s is None for s in said):
            return


class _Step(Protocol):
    """One step of a per-tensor share (see :func:`_each_step`)."""

    own: Any
    error: str | None

    def offer(self) -> tuple[str, Any] | None: ...

    def hand_over(self, said: list[Any]) -> Iterator[tuple[str, Any]]: ...


class _BroadcastStep(Iterator[tuple[str, Any]]):
    """One step of a broadcast: this rank's offer (its next own tensor, :attr:`own`),
    then every tensor offered, in rank order, each broadcast from its owner and handed
    over. It lets go of its own tensor as it hands it over."""

    def __init__(self, steps: _Steps, device: DevicePath, data_group: Any) -> None:
        self.steps, self.device, self.data_group = steps, device, data_group
        self.own: tuple[str, Any] | None = None
        self.error: str | None = None  # a broadcast's failure is the collective's own
        self._said: list[Any] = []
        self._next_rank = 0

    def offer(self) -> tuple[str, Any] | None:
        if self.own is None:
            return None
        name, tensor = self.own
        return ("tensor", (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)))

    def hand_over(self, said: list[Any]) -> _BroadcastStep:
        self._said, self._next_rank = said, 0
        return self

    def __next__(self) -> tuple[str, Any]:
        import torch

        share = self.steps.share
        while self._next_rank < len(self._said):
            rank, step = self._next_rank, self._said[self._next_rank]
            self._next_rank += 1
            if step is None or step[0] != "tensor":
                continue
            name, dtype_name, shape = step[1]
            if rank == share.rank:
                assert self.own is not None
                tensor, self.own = self.own[1].contiguous(), None
            else:
                tensor = self.device.receive_buffer(getattr(torch, dtype_name), shape)
            raw = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor
            if raw.numel():
                self.steps.broadcast(raw, share.global_ranks[rank], self.data_group)
            return name, tensor
        raise StopIteration


# -- stream ----------------------------------------------------------------------------

# How long a streaming rank waits for a tensor of its own before it steps on without
# one: short next to the load, long next to a step. Measured (4 ranks, 3.8 GiB from the
# FUSE mirror, 2 cores): at 20 ms the idle steps cost the ranks 7.0-7.3 s of CPU and the
# load 1.14-1.19x a plain hydrate; at 100 ms 4.9 s and 1.05-1.06x, the first tensor at
# 0.72 s (1.07-1.66 s with no idle steps).
STREAM_IDLE_S = 0.1
# The most tensors a streaming rank offers in one step.
STREAM_BATCH = 64


def _by_stream(
    runner: Runner,
    steps: _Steps,
    files: list[Path],
    local: Path | None,
    delivery: TensorDelivery,
    device: DevicePath,
) -> SharedPairs:
    """Steps as in a broadcast, but no byte moves between ranks: at each step each rank
    names the tensors of its own that landed since the last (and, with a file's first,
    the file's header), or that none did; the others map the file it is reading (or,
    in a one pass, the copy it is writing) and take each tensor from their mapping,
    touching only the pages they use. A one pass's copy leaves the page cache tensor by
    tensor as every rank has had it (see :mod:`loaderplug.tensors.copy_pages`)."""
    # A rank with no tensor of its own yet steps on without one after a moment, so that
    # the others' tensors reach it: the first tensor reaches every rank when the first
    # rank has one, not when the last does.
    delivery.idle_after_s = STREAM_IDLE_S
    events = runner.run()
    files_mapped = _MappedFiles(files, local, device)
    index = {f.name: i for i, f in enumerate(files)}
    told: set[int] = set()  # the files whose header this rank has sent
    pages = ConsumedPages([local / f.name for f in files]) if local is not None else None

    def new_step() -> _StreamStep:
        return _StreamStep(steps, files_mapped, index, delivery.headers, told, pages)

    try:
        yield from _each_step(LandedBatches(events, delivery), new_step, steps)
        # Every rank past the last step lets go of its mappings, so that what is left
        # of a one pass's copy in the page cache can go too (but the tensors the
        # consumers still hold). On every rank alike, whatever its local folder.
        files_mapped.close()
        steps.exchange(None)
    finally:
        events.close()
        files_mapped.close()
        if pages is not None:
            pages.close()


class _MappedFiles:
    """The other ranks' files as this rank maps them, each on its first tensor."""

    def __init__(self, files: list[Path], local: Path | None, device: DevicePath) -> None:
        self.files, self.local, self.device = files, local, device
        self.headers: dict[int, Header] = {}
        self._open: dict[int, MappedFile] = {}

    def tensor(self, index: int, name: str) -> Any:
        if index not in self._open:
            self._open[index] = self._map(index)
        return self.device.to_device(self._open[index].tensor(name))

    def _map(self, index: int) -> MappedFile:
        """Map where the file's bytes are: in a one pass the copy being written or, once
        published (renamed into place), the copy; else the file being read."""
        header = self.headers[index]
        if self.local is None:
            return MappedFile(header, str(self.files[index]))
        return open_copy(self.local / self.files[index].name, lambda p: MappedFile(header, str(p)))

    def close(self) -> None:
        for mapped in self._open.values():
            mapped.close()
        self._open.clear()


class LandedBatches(Iterator["collections.deque[TensorReady] | Idle"]):
    """This rank's own tensors, for a stream's steps: every one landed by now (at least
    one, at most :data:`STREAM_BATCH`), or :class:`Idle` where none landed within the
    delivery's ``idle_after_s``. A step offers them all: a model of many small tensors
    takes a few steps, not one per tensor. Finished files are passed over (a failed
    one raises); past the first tensor only events already waiting are taken, so a
    finished file at the end of a batch never holds the step back."""

    def __init__(self, events: Iterator[Any], delivery: TensorDelivery) -> None:
        self._events = events
        self._delivery = delivery

    def __next__(self) -> collections.deque[TensorReady] | Idle:
        for event in self._events:
            if isinstance(event, Idle):
                return event
            if isinstance(event, FileFinished):
                raise_if_failed(event)
                continue
            return self._batch(event)
        raise StopIteration

    def _batch(self, first: TensorReady) -> collections.deque[TensorReady]:
        batch = collections.deque([first])
        while len(batch) < STREAM_BATCH and self._delivery.has_waiting():
            event = next(self._events, None)
            if isinstance(event, FileFinished):
                raise_if_failed(event)
            elif isinstance(event, TensorReady):
                batch.append(event)
            else:
                break  # the end (the next call says so); an Idle cannot wait here
        return batch


class _StreamStep(Iterator[tuple[str, Any]]):
    """One step of a stream: this rank's offer (its own tensors landed by now,
    :attr:`own`, or that it has none yet), then every tensor offered, in rank order: its
    own from its memory, the others' from the mappings. It lets go of each own tensor
    as it hands it over; with ``pages``, the copy's pages of the tensors it offered two
    steps before leave the page cache."""

    def __init__(
        self,
        steps: _Steps,
        files: _MappedFiles,
        index: dict[str, int],
        headers: dict[str, Header],
        told: set[int],
        pages: ConsumedPages | None,
    ) -> None:
        self.steps, self.files = steps, files
        self.index, self.headers, self.told = index, headers, told
        self.pages = pages
        self.own: collections.deque[TensorReady] | Idle | None = None
        self.error: str | None = None  # a mapping this rank could not make
        self._said: list[Any] = []
        self._next_rank = 0
        self._next_item = 0  # in the offer of rank ``_next_rank``

    def offer(self) -> tuple[str, Any] | None:
        if self.own is None:
            return None
        if isinstance(self.own, Idle):
            return ("waiting", None)
        offers = []
        for ready in self.own:
            file, header = self.index[ready.rel], self.headers[ready.rel]
            if self.pages is not None:
                self.pages.offered(file, header, ready.name)
            offers.append((file, ready.name, header if file not in self.told else None))
            self.told.add(file)
        return ("tensors", offers)

    def hand_over(self, said: list[Any]) -> _StreamStep:
        self._said, self._next_rank, self._next_item = said, 0, 0
        if self.pages is not None:
            self.pages.step_entered(handed=any(s is not None and s[0] == "tensors" for s in said))
        return self

    def __next__(self) -> tuple[str, Any]:
        while self._next_rank < len(self._said):
            rank, step = self._next_rank, self._said[self._next_rank]
            if step is None or step[0] != "tensors" or self._next_item == len(step[1]):
                self._next_rank, self._next_item = self._next_rank + 1, 0
                continue
            file, name, header = step[1][self._next_item]
            self._next_item += 1
            if rank == self.steps.share.rank:
                assert isinstance(self.own, collections.deque)
                return name, self.own.popleft().tensor
            if header is not None:
                self.files.headers[file] = header
            try:
                return name, self.files.tensor(file, name)
            except OSError as exc:
                self.error = f"cannot map {self.files.files[file].name}: {exc}"
                break
        raise StopIteration


# -- steps -----------------------------------------------------------------------------


# How long a failed collective waits to see whether a peer died, to name it.
PEER_EXIT_S = 1.0


class _Steps:
    """The share's collectives, each waited for with an eye on the peers: a collective
    on the share's (gloo) group is started asynchronously and waited for in short
    slices, so a peer's death ends the wait at once, whatever gloo makes of it."""

    # How long one slice of a wait is: the most a death can go unnoticed in a wait.
    WAKE = datetime.timedelta(milliseconds=250)

    def __init__(self, share: Share, watch: PeerWatch) -> None:
        self.share = share
        self.watch = watch
        self.pending: Any = None  # a collective not waited out (a peer died during it)

    def exchange(self, news: tuple[str, Any] | None) -> list[tuple[str, Any] | None]:
        """Tell the other ranks ``news`` and hear theirs; an error anywhere (a rank's
        error, a dead rank) is raised here, on every rank alike."""
        import torch
        import torch.distributed as dist

        self.watch.check()
        size, group = self.share.size, self.share.group
        # As all_gather_object does, in two collectives (lengths, then the padded
        # bytes), but asynchronous, so the wait can watch the peers.
        payload = torch.frombuffer(bytearray(pickle.dumps(news)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        self._wait(dist.all_gather(lengths, length, group=group, async_op=True))
        longest = max(int(n.item()) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
        self._wait(dist.all_gather(gathered, padded, group=group, async_op=True))
        said: list[tuple[str, Any] | None] = [
            pickle.loads(data[: int(n.item())].numpy().tobytes())
            for data, n in zip(gathered, lengths, strict=True)
        ]
        for rank, step in enumerate(said):
            if step is not None and step[0] == "error":
                raise DistributedError(
                    f"rank {self.share.global_ranks[rank]} of the shared load failed: {step[1]}"
                )
        return said

    def broadcast(self, raw: Any, src: int, group: Any) -> None:
        """``raw`` from global rank ``src`` to the others over ``group``: the share's
        own, watched, or an NCCL group (blocking: NCCL's own watchdog guards it)."""
        import torch.distributed as dist

        if group is not self.share.group:
            _collective(dist.broadcast, raw, src=src, group=group)
            return
        self._wait(dist.broadcast(raw, src=src, group=group, async_op=True))

    def _wait(self, work: Any) -> None:
        self.pending = work
        while True:
            self.watch.check()
            try:
                work.wait(timeout=self.WAKE)
                self.pending = None
                return
            except RuntimeError as exc:
                if not work.is_completed():
                    continue  # only this slice of the wait ran out
                if _completed_well(work):
                    # The slice ran out a moment before the collective completed:
                    # gloo says "timed out", yet it is done and went well.
                    self.pending = None
                    return
                # A peer's death closes its sockets a moment before it is seen to exit.
                self.watch.check(wait_s=PEER_EXIT_S)
                raise _stopped_answering(exc) from exc


def _completed_well(work: Any) -> bool:
    """Whether a completed collective succeeded: waiting for it again returns at once
    if it did, and raises its error if it failed."""
    try:
        work.wait(timeout=_Steps.WAKE)
    except RuntimeError:
        return False
    return True


def _collective(op: Any, *args: Any, **kwargs: Any) -> Any:
    """A collective; a rank that stopped answering (dead, or stuck past the timeout) is
    a clear error rather than a backend's."""
    try:
        return op(*args, **kwargs)
    except RuntimeError as exc:
        if isinstance(exc, LoaderplugError):
            raise
        raise _stopped_answering(exc) from exc


def _abandon(group: Any, work: Any) -> None:
    """Keep ``group`` and its ``work`` alive for good. A collective left pending when a
    peer died is not always failed by gloo (a receive from the dead rank can wait for
    the whole timeout), and freeing its group joins gloo's thread, which waits for that
    receive: the rank would hang where it raised, or at exit, for up to ten minutes.
    Never freed, the group costs a thread and a few sockets until the process ends."""
    import ctypes

    for kept in (group, work):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))


def _stopped_answering(exc: BaseException) -> DistributedError:
    return DistributedError(
        f"a rank of the shared load stopped answering ({exc}); it may have died, or be "
        f"slower than LOADERPLUG_DISTRIBUTED_TIMEOUT_S allows"
    )
