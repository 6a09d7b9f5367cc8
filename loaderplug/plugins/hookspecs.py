"""Every loaderplug hook, grouped by phase.

Hooks are called with keyword arguments only, through :class:`loaderplug.plugins.manager.Plugins`.
Every hook receives ``settings``, the :class:`~loaderplug.settings.Settings` of the job
that calls it; an implementation takes any subset of a hook's arguments, so one written
before an argument was added keeps working. ``firstresult`` hooks stop at the first
plugin that returns something other than ``None``; built-in implementations are
registered ``trylast``, so any third-party plugin that answers wins. Observe hooks are
called on every plugin and their return values are ignored; one that raises is logged
and never fails the job. Observe hooks may run on worker threads: keep them quick and
thread-safe.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

from loaderplug.types import DirectIO, FileResult, IOPolicy, MirrorRequest, Source

if TYPE_CHECKING:
    from loaderplug.devices.backend import DeviceBackend
    from loaderplug.report import TransferReport
    from loaderplug.settings import Settings

PROJECT = "loaderplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- locate -------------------------------------------------------------------------


@hookspec(firstresult=True)
def loaderplug_find_mirror(request: MirrorRequest, settings: Settings) -> Path | None:
    """Where a copy of ``request`` lives on a volume mirror, or ``None`` if nowhere.

    The built-in answer comes from ``settings.mirror`` (``LOADERPLUG_MIRROR``, or a
    loader's own mirror option).
    """


# -- policy -------------------------------------------------------------------------


@hookspec(firstresult=True)
def loaderplug_io_policy(path: str, mode: DirectIO, settings: Settings) -> IOPolicy | None:
    """How to read ``path``: O_DIRECT or buffered, with alignment and reason.

    ``mode`` is ``auto``, ``on`` or ``off``: the job's ``settings.direct_io``.
    """


# -- move ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def loaderplug_open_source(path: str, policy: IOPolicy, settings: Settings) -> Source | None:
    """Open ``path`` for reading: an object with ``size``, ``identity()``,
    ``pread_into(buf, offset)`` and ``close()`` (see :class:`loaderplug.types.Source`).

    Called by each worker thread for each file it reads from (its own descriptor), and
    once more before a file is published, to check that it held still. A plugin can
    serve another backend (S3, a cache) or wrap the built-in source to observe or
    inject faults.
    """


@hookspec(firstresult=True)
def loaderplug_device_backend(device: str, settings: Settings) -> DeviceBackend | None:
    """The backend that moves a load's tensors to ``device`` ("cuda:0"), or ``None``
    where tensors are assembled in host memory (and moved with ``.to(device)`` if the
    device is not the CPU).

    Asked once per load. The built-in answer is a CUDA backend (pinned buffers the
    engine reads into, copies on side streams) for a CUDA device torch can use; a
    plugin can serve another accelerator, or a stand-in for tests (see
    :class:`loaderplug.devices.backend.DeviceBackend`).
    """


# -- observe ------------------------------------------------------------------------


@hookspec
def loaderplug_on_span_done(
    job: str, path: str, offset: int, length: int, retries: int, settings: Settings
) -> None:
    """A span of ``path`` landed in every sink of its file (``job``: hydrate, sync or
    load)."""


@hookspec(
    warn_on_impl=DeprecationWarning(
        "the loaderplug hook loaderplug_on_range_done is now loaderplug_on_span_done "
        "(same arguments); the old name goes in the next release"
    )
)
def loaderplug_on_range_done(
    job: str, path: str, offset: int, length: int, retries: int, settings: Settings
) -> None:
    """Deprecated: :func:`loaderplug_on_span_done`, called with it."""


@hookspec
def loaderplug_on_file_done(job: str, result: FileResult, settings: Settings) -> None:
    """A file was published, loaded, linked, skipped or failed."""


@hookspec
def loaderplug_on_tensor_ready(
    job: str, path: str, name: str, tensor: Any, settings: Settings
) -> None:
    """Tensor ``name`` of the file ``path`` is complete and about to be handed to the
    consumer (called on the consumer's thread, just before it receives the tensor)."""


@hookspec
def loaderplug_on_job_done(report: TransferReport, settings: Settings) -> None:
    """A job finished; ``report`` says what happened to every file."""
