"""Every loaderplug hook, grouped by phase.

Hooks are called with keyword arguments only. ``firstresult`` hooks stop at the first
plugin that returns something other than ``None``; built-in implementations are
registered ``trylast``, so any third-party plugin that answers wins. Observe hooks are
called on every plugin and their return values are ignored. Observe hooks run on worker
threads: keep them quick and thread-safe.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from loaderplug.fs import IOPolicy
    from loaderplug.report import FileResult, TransferReport
    from loaderplug.source import Source
    from loaderplug.volume import MirrorRequest

PROJECT = "loaderplug"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# -- locate -------------------------------------------------------------------------


@hookspec(firstresult=True)
def loaderplug_find_mirror(request: MirrorRequest) -> Path | None:
    """Where a copy of ``request`` lives on a volume mirror, or ``None`` if nowhere.

    The built-in answer comes from ``LOADERPLUG_VOLUME``.
    """


# -- policy -------------------------------------------------------------------------


@hookspec(firstresult=True)
def loaderplug_io_policy(path: str, mode: str) -> IOPolicy | None:
    """How to read ``path``: O_DIRECT or buffered, with alignment and reason.

    ``mode`` is ``auto``, ``on`` or ``off`` (``LOADERPLUG_DIRECT_IO`` or a call's argument).
    """


# -- move ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def loaderplug_open_source(path: str, policy: IOPolicy) -> Source | None:
    """Open ``path`` for reading: an object with ``size``, ``identity()``,
    ``pread_into(buf, offset)`` and ``close()`` (see :class:`loaderplug.source.Source`).

    Called once per range, by the worker thread that reads it. A plugin can serve another
    backend (S3, a cache) or wrap the built-in source to observe or inject faults.
    """


# -- observe ------------------------------------------------------------------------


@hookspec
def loaderplug_on_range_done(job: str, path: str, offset: int, length: int, retries: int) -> None:
    """A range of ``path`` landed at its destination (``job`` is hydrate or sync)."""


@hookspec
def loaderplug_on_file_done(job: str, result: FileResult) -> None:
    """A file was published, skipped or failed."""


@hookspec
def loaderplug_on_job_done(report: TransferReport) -> None:
    """A hydrate or sync finished; ``report`` says what happened to every file."""
