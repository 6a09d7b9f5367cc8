"""Loads as plans: which files a load reads, where a one pass publishes them, and how
their tensors are handed over (see :mod:`loaderplug.jobs.runner`).

A load is a job like a hydrate: with ``local_dir`` (a one pass) it runs under the local
folder's lock, or, for ranks that split the files between them, under a lock per file it
publishes, so the ranks copy side by side.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from loaderplug.engine.sinks import Sink
from loaderplug.errors import HydrateError
from loaderplug.jobs.file_sink import temps_of
from loaderplug.jobs.locks import file_lock, folder_lock
from loaderplug.jobs.plan import Emit, FileEntry, Listing, Plan
from loaderplug.settings import Settings
from loaderplug.storage.mounts import is_network_type
from loaderplug.tensors.budget import MemoryBudget
from loaderplug.tensors.header import Header
from loaderplug.tensors.sinks import DeviceTensorSink, TensorSink, mapped_tensors
from loaderplug.tensors.staging import StagingPool, backend_for, pool_for
from loaderplug.types import IOPolicy


class _Delivery:
    """How a load hands tensors over (see :class:`loaderplug.jobs.plan.TensorDelivery`)."""

    def __init__(self, device: str, bytes_in_flight: int, may_map: bool) -> None:
        self.device = device
        # Host memory for tensors being assembled or not yet taken by the consumer.
        self.budget = MemoryBudget(bytes_in_flight)
        backend = backend_for(device)
        self.pool: StagingPool | None = (
            pool_for(backend, bytes_in_flight) if backend is not None else None
        )
        self.may_map = may_map and device == "cpu"

    def sink(self, header: Header, emit: Emit) -> Sink:
        if self.pool is not None:
            return DeviceTensorSink(header, self.pool, emit)
        return TensorSink(header, self.device, emit, self.budget)

    def maps(self, policy: IOPolicy) -> bool:
        # Buffered on a local filesystem means the bytes are in memory already (tmpfs,
        # or a file mostly in the page cache): mapping them beats copying them.
        return self.may_map and not policy.direct and not is_network_type(policy.fs_type)

    def mapped(self, header: Header) -> Iterator[tuple[str, Any]]:
        return mapped_tensors(header)

    def taken(self, tensor: Any) -> None:
        # A tensor assembled on the host leaves the budget once its consumer has it.
        if self.pool is None:
            self.budget.release(tensor.untyped_storage().nbytes())


def load_plan(
    paths: Sequence[str | os.PathLike[str]],
    device: str,
    settings: Settings,
    local_dir: str | os.PathLike[str] | None = None,
    *,
    lock_each_file: bool = False,
) -> Plan:
    """The plan of a load: each file read in place, or with ``local_dir`` hydrated there
    (same name) in the same pass, under that folder's lock (with ``lock_each_file``,
    under a lock per file instead)."""
    files = [Path(p) for p in paths]
    local = Path(local_dir) if local_dir is not None else None

    def list_files() -> Listing:
        listing = Listing()
        for path in files:
            try:
                st = os.stat(path)
            except OSError as exc:
                raise HydrateError(
                    f"{path}: cannot read it: {exc.strerror or exc}",
                    path=str(path),
                    errno=exc.errno,
                ) from exc
            copy_to = local / path.name if local is not None else None
            listing.files.append(FileEntry.of(path.name, path, st, copy_to))
        return listing

    return Plan(
        job="load",
        source=",".join(map(str, paths)),
        destination=local,
        list_files=list_files,
        locks=_locks(local, files, lock_each_file),
        leftovers=lambda: [t for f in files for t in temps_of(local / f.name)] if local else [],
        tensors=_Delivery(device, settings.bytes_in_flight, may_map=True),
    )


def _locks(local: Path | None, files: list[Path], each_file: bool) -> tuple[Path, ...]:
    if local is None:
        return ()
    if not each_file:
        return (folder_lock(local),)
    # Sorted: two jobs that share some files take their locks in the same order.
    return tuple(sorted(file_lock(local / f.name) for f in files))
