"""loaderplug: fast, safe model cold starts.

Range-parallel hydrate from a volume mirror to local disk, and sync back, a streaming
safetensors reader, and pluggy hooks for locating mirrors, choosing IO policy, opening
sources and observing progress.
"""

from pathlib import Path
from typing import TYPE_CHECKING

from loaderplug.errors import (
    DestinationError,
    DistributedError,
    FileError,
    FormatError,
    LoaderplugError,
    LockError,
    MirrorError,
    PluginError,
    SettingsError,
    TransferFailed,
    UpstreamChanged,
    WeightsError,
)
from loaderplug.jobs.copies import hydrate, sync
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.report import TransferReport
from loaderplug.settings import Settings, from_env
from loaderplug.types import (
    DirectIO,
    Distributed,
    FileResult,
    HostSplit,
    IOPolicy,
    MirrorKind,
    MirrorRequest,
    Owned,
    RankSharing,
    WeightsDevice,
    WeightsReader,
)

if TYPE_CHECKING:  # at run time these come with their first use (they need torch)
    from loaderplug.tensors.delivery.load import Load
    from loaderplug.tensors.reader import iter_tensors, load_file

__all__ = [
    "DestinationError",
    "DirectIO",
    "Distributed",
    "DistributedError",
    "FileError",
    "FileResult",
    "FormatError",
    "HostSplit",
    "IOPolicy",
    "Load",
    "LoaderplugError",
    "LockError",
    "MirrorError",
    "MirrorKind",
    "MirrorRequest",
    "Owned",
    "PluginError",
    "RankSharing",
    "Settings",
    "SettingsError",
    "TransferFailed",
    "TransferReport",
    "UpstreamChanged",
    "WeightsDevice",
    "WeightsError",
    "WeightsReader",
    "find_mirror",
    "from_env",
    "hookimpl",
    "hydrate",
    "io_policy",
    "iter_tensors",
    "load_file",
    "register",
    "sync",
    "unregister",
]


def __getattr__(name: str) -> object:
    # The reader needs torch; import it only when someone asks for it.
    if name in ("iter_tensors", "load_file", "Load"):
        from loaderplug.tensors import reader
        from loaderplug.tensors.delivery import load

        return getattr(load if name == "Load" else reader, name)
    if name == "HydrateError":  # renamed: errors.py warns
        from loaderplug import errors

        return errors.HydrateError
    raise AttributeError(f"module 'loaderplug' has no attribute {name!r}")


def io_policy(path: str, direct_io: str | None = None) -> IOPolicy:
    """How loaderplug would read ``path`` (``direct_io``: auto, on or off)."""
    from loaderplug.plugins.manager import Plugins

    settings = from_env() if direct_io is None else from_env(direct_io=direct_io)
    return Plugins(settings).io_policy(path)


def find_mirror(
    kind: MirrorKind, name: str, revision: str | None = None, settings: Settings | None = None
) -> Path | None:
    """Where the mirror holds ``name`` (a folder model, or with ``kind="hub"`` the Hub
    layout's root), as the plugins find it; None where it holds nothing."""
    from loaderplug.plugins.manager import Plugins

    request = MirrorRequest(kind, name, revision)
    return Plugins(settings or from_env()).find_mirror(request)


def register(plugin: object, name: str | None = None) -> None:
    """Register a plugin (an object or module with ``@hookimpl`` methods) for every job
    that follows in this process."""
    from loaderplug.plugins.manager import register as register_plugin

    register_plugin(plugin, name)


def unregister(plugin: object) -> None:
    """Unregister a plugin :func:`register` registered."""
    from loaderplug.plugins.manager import unregister as unregister_plugin

    unregister_plugin(plugin)
