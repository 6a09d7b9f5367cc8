"""Exceptions raised by loaderplug.

Every error loaderplug raises on purpose derives from :class:`LoaderplugError`::

    LoaderplugError
    ├── SettingsError      a LOADERPLUG_* variable or override has a bad value
    ├── FormatError        a safetensors file is malformed
    ├── HydrateError       a file could not be copied (carries path, range, errno)
    │   └── TransferFailed one or more files of a job failed (carries the report)
    ├── MirrorError        a mirror or its manifest cannot be trusted
    ├── LockError          the cross-process lock could not be taken in time
    └── PluginError        a plugin could not be loaded or answered badly

``OSError`` is translated once, at the IO boundary, keeping its errno and chaining the
original with ``from``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loaderplug.report import TransferReport


class LoaderplugError(Exception):
    """Root of every error loaderplug raises on purpose."""


class SettingsError(LoaderplugError, ValueError):
    """A setting has a value loaderplug cannot use."""


class FormatError(LoaderplugError, ValueError):
    """A safetensors file breaks the format."""


class MirrorError(LoaderplugError):
    """A mirror, or its manifest, cannot be trusted."""


class LockError(LoaderplugError):
    """Another process held the destination's lock for too long."""


class PluginError(LoaderplugError):
    """A plugin failed to load or returned something unusable."""


class HydrateError(LoaderplugError):
    """One file could not be copied.

    ``range`` is ``(offset, length)`` of the byte range that failed, when one did;
    ``errno`` is the operating-system error number, when the cause was an ``OSError``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str,
        range: tuple[int, int] | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.range = range
        self.errno = errno


class TransferFailed(HydrateError):
    """A hydrate or sync finished with failed files; ``report`` lists each one."""

    def __init__(self, report: TransferReport) -> None:
        failures = report.failed
        first = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        super().__init__(
            f"{report.job} failed for {len(failures)} file(s): {first.path}: {first.reason}{more}",
            path=first.path,
            range=first.range,
            errno=first.errno,
        )
        self.report = report
