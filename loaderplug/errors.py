"""Exceptions raised by loaderplug.

Every error loaderplug raises on purpose derives from :class:`LoaderplugError`::

    LoaderplugError
    ├── SettingsError      a setting, flag or option has a bad value (names which, and why)
    ├── FormatError        a safetensors file is malformed
    ├── FileError       one file could not be copied or read (carries path, range, errno)
    ├── TransferFailed     a job finished with failed files (carries the report)
    ├── DistributedError   a rank of a shared load failed or stopped answering
    ├── MirrorError        a mirror or its manifest cannot be trusted
    ├── DestinationError   a destination cannot take the copy (a file, read-only)
    ├── LockError          the cross-process lock could not be taken in time
    ├── PluginError        a plugin could not be loaded or answered badly
    ├── WeightsError       vLLM's volcache loader cannot find or choose the model's weights
    └── UpstreamChanged    an integrated library lost a name loaderplug relies on

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
    """A setting has a value loaderplug cannot use.

    ``variable`` names it as the user set it (``LOADERPLUG_SPAN_BYTES``, ``--workers``,
    a loader option), ``value`` is what was given and ``expected`` the accepted form and
    range; :meth:`renamed` says the same of another name for the same setting.
    """

    def __init__(
        self,
        variable: str,
        value: object,
        expected: str,
        hint: str = "",
        *,
        message: str | None = None,
    ) -> None:
        super().__init__(message or f"{variable}={value!r} is invalid: expected {expected}{hint}")
        self.variable = variable
        self.value = value
        self.expected = expected
        self.hint = hint

    def renamed(self, variable: str) -> SettingsError:
        return SettingsError(variable, self.value, self.expected, self.hint)


class FormatError(LoaderplugError, ValueError):
    """A safetensors file breaks the format."""


class MirrorError(LoaderplugError):
    """A mirror, or its manifest, cannot be trusted."""


class DestinationError(LoaderplugError):
    """A job's destination cannot take what it must publish: it is a file, lies under
    one, or is read-only with files to write."""


class LockError(LoaderplugError):
    """Another process held the destination's lock for too long."""


class DistributedError(LoaderplugError):
    """A rank of a load shared by a process group failed, or stopped answering; every
    rank of the group raises it, naming the rank."""


class PluginError(LoaderplugError):
    """A plugin failed to load or returned something unusable."""


class FileError(LoaderplugError):
    """One file could not be copied or read.

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


class TransferFailed(LoaderplugError):
    """A hydrate, sync or load finished with failed files; ``report`` lists each one,
    and ``path``, ``range`` and ``errno`` are those of the first."""

    def __init__(self, report: TransferReport) -> None:
        failures = report.failed
        first = failures[0]
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        super().__init__(
            f"{report.job} failed for {len(failures)} file(s): {first.path}: {first.reason}{more}"
        )
        self.report = report
        self.path = first.path
        self.range = first.range
        self.errno = first.errno


class WeightsError(LoaderplugError):
    """The model's weights cannot be found or chosen (vLLM's ``volcache`` loader)."""


class UpstreamChanged(LoaderplugError):
    """An upstream library no longer has a name loaderplug relies on (or has it with
    another value): ``library``, its installed ``version``, the ``symbol`` (an
    ``integrations.upstream.Symbol``: the name and what it was for)."""

    def __init__(
        self, message: str, library: str = "", version: str = "", symbol: object = None
    ) -> None:
        super().__init__(message)
        self.library = library
        self.version = version
        self.symbol = symbol

    def __reduce__(self) -> tuple[type[UpstreamChanged], tuple[str, str, str, object]]:
        # Picklable with its fields, for errors that cross process boundaries.
        return type(self), (str(self), self.library, self.version, self.symbol)


# Renamed exceptions (old name: new one), importable under the old name for one release.
_RENAMED = {"HydrateError": "FileError"}


def __getattr__(name: str) -> type[LoaderplugError]:
    if name in _RENAMED:
        import warnings

        warnings.warn(
            f"loaderplug's {name} is now {_RENAMED[name]} (it was raised by syncs and loads "
            f"too); the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        renamed: type[LoaderplugError] = globals()[_RENAMED[name]]
        return renamed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
