"""loaderplug: fast, safe model cold starts.

Range-parallel hydrate from a volume mirror to local disk, and sync back, a streaming
safetensors reader, and pluggy hooks for locating mirrors, choosing IO policy, opening
sources and observing progress.
"""

from loaderplug.errors import (
    DestinationError,
    DistributedError,
    FormatError,
    HydrateError,
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
from loaderplug.types import FileResult, IOPolicy, MirrorRequest

__all__ = [
    "DestinationError",
    "DistributedError",
    "FileResult",
    "FormatError",
    "HydrateError",
    "IOPolicy",
    "LoaderplugError",
    "LockError",
    "MirrorError",
    "MirrorRequest",
    "PluginError",
    "Settings",
    "SettingsError",
    "TransferFailed",
    "TransferReport",
    "UpstreamChanged",
    "WeightsError",
    "from_env",
    "hookimpl",
    "hydrate",
    "io_policy",
    "iter_tensors",
    "load_file",
    "sync",
]


def __getattr__(name: str) -> object:
    # The reader needs torch; import it only when someone asks for it.
    if name in ("iter_tensors", "load_file"):
        from loaderplug.tensors import reader

        return getattr(reader, name)
    raise AttributeError(f"module 'loaderplug' has no attribute {name!r}")


def io_policy(path: str, direct_io: str | None = None) -> IOPolicy:
    """How loaderplug would read ``path`` (``direct_io``: auto, on or off)."""
    from loaderplug.plugins.manager import Plugins

    settings = from_env() if direct_io is None else from_env(direct_io=direct_io)
    return Plugins(settings).io_policy(path)
