"""Streaming safetensors reader: tensors are yielded as soon as their last byte lands.

Files are read by the range engine (range-parallel, under the IO policy of each file);
a tensor sink per file (:mod:`loaderplug.tensor_sinks`) scatters every landed range into
the tensors it covers and hands over each tensor the moment it is complete, while other
ranges are still in flight. Each yielded tensor owns its memory: it is never a view into
a reused buffer.

With ``local_dir`` the same pass also hydrates: each range read from the mirror is
written to a local temp file and fed to the tensor sink, so every byte is read from the
volume once. It is a job like a hydrate (:mod:`loaderplug.runner`): under the local
folder's lock, leftovers of a killed run swept, and a local copy that is current already
read from local disk instead of the mirror.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loaderplug.errors import HydrateError, TransferFailed
from loaderplug.fs import is_network_type
from loaderplug.header import Header
from loaderplug.plan import Emit, FileEntry, Listing, Plan
from loaderplug.runner import Runner
from loaderplug.settings import Settings, from_env
from loaderplug.sinks import Sink, temps_of
from loaderplug.staging import StagingPool, backend_for, pool_for
from loaderplug.tensor_sinks import DeviceTensorSink, TensorSink, mapped_tensors
from loaderplug.types import Identity, IOPolicy

if TYPE_CHECKING:
    import torch


class _Delivery:
    """How a load hands tensors over (see :class:`loaderplug.plan.TensorDelivery`)."""

    def __init__(self, device: str, bytes_in_flight: int, may_map: bool) -> None:
        self.device = device
        backend = backend_for(device)
        self.pool: StagingPool | None = (
            pool_for(backend, bytes_in_flight) if backend is not None else None
        )
        self.may_map = may_map and device == "cpu"

    def sink(self, header: Header, emit: Emit) -> Sink:
        if self.pool is not None:
            return DeviceTensorSink(header, self.pool, emit)
        return TensorSink(header, self.device, emit)

    def maps(self, policy: IOPolicy) -> bool:
        # Buffered on a local filesystem means the bytes are in memory already (tmpfs,
        # or a file mostly in the page cache): mapping them beats copying them.
        return self.may_map and not policy.direct and not is_network_type(policy.fs_type)

    def mapped(self, header: Header) -> Iterator[tuple[str, Any]]:
        return mapped_tensors(header)


def load_plan(
    paths: Sequence[str | os.PathLike[str]],
    device: str,
    settings: Settings,
    local_dir: str | os.PathLike[str] | None = None,
) -> Plan:
    """The plan of a load: each file read in place, or with ``local_dir`` hydrated there
    (same name) in the same pass, under that folder's lock."""
    files = [Path(p) for p in paths]
    local = Path(local_dir) if local_dir is not None else None

    def list_files() -> Listing:
        listing = Listing()
        for path in files:
            try:
                identity = Identity.of(os.stat(path))
            except OSError as exc:
                raise HydrateError(
                    f"{path}: cannot read it: {exc.strerror or exc}",
                    path=str(path),
                    errno=exc.errno,
                ) from exc
            copy_to = local / path.name if local is not None else None
            listing.files.append(FileEntry(path.name, path, identity, copy_to))
        return listing

    return Plan(
        job="load",
        source=",".join(map(str, paths)),
        destination=local,
        list_files=list_files,
        lock_dir=local,
        leftovers=lambda: [t for f in files for t in temps_of(local / f.name)] if local else [],
        tensors=_Delivery(device, settings.bytes_in_flight, may_map=True),
    )


def iter_tensors(
    paths: Sequence[str | os.PathLike[str]],
    device: str = "cpu",
    *,
    local_dir: str | os.PathLike[str] | None = None,
    settings: Settings | None = None,
    stats: dict[str, Any] | None = None,
    **overrides: Any,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from safetensors ``paths`` as each tensor completes.

    With ``local_dir``, each file is also hydrated there (same name) in the same pass,
    with every guarantee of a hydrate. A file that fails raises :class:`TransferFailed`
    naming it; a tensor is only ever yielded whole. ``stats``, if given, receives the
    job's report, the time to first tensor and how each file was read.
    """
    job_settings = (settings or from_env()).replace(**overrides)
    runner = Runner(load_plan(paths, device, job_settings, local_dir), job_settings)
    yield from runner.tensors()
    report = runner.report
    assert report is not None
    if stats is not None:
        stats.update(report=report, first_tensor_s=runner.first_tensor_s, io=runner.io_modes)
    if not report.ok:
        raise TransferFailed(report)


def load_file(path: str | os.PathLike[str], device: str = "cpu") -> dict[str, torch.Tensor]:
    """A drop-in for ``safetensors.torch.load_file``: every tensor, owned, on ``device``."""
    return dict(iter_tensors([path], device))
