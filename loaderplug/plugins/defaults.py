"""Built-in behaviour, registered as a plugin so a third-party plugin can replace it."""

from __future__ import annotations

from pathlib import Path

from loaderplug.devices.backend import DeviceBackend
from loaderplug.devices.cuda import cuda_backend
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.settings import Settings
from loaderplug.storage.io_policy import decide
from loaderplug.storage.source import PosixSource
from loaderplug.types import DirectIO, IOPolicy, MirrorRequest, Source


@hookimpl(trylast=True)
def loaderplug_find_mirror(request: MirrorRequest, settings: Settings) -> Path | None:
    if not settings.mirror:
        return None
    volume = Path(settings.mirror)
    candidate = volume / request.subpath
    if request.kind == "hub":
        # The Hub layout's root: its repos are looked up (and created) inside it.
        return candidate if volume.is_dir() else None
    return candidate if candidate.exists() else None


@hookimpl(trylast=True)
def loaderplug_io_policy(path: str, mode: DirectIO, settings: Settings) -> IOPolicy:
    return decide(path, mode, measure=settings.io_probe)


@hookimpl(trylast=True)
def loaderplug_open_source(path: str, policy: IOPolicy) -> Source:
    return PosixSource(path, policy)


@hookimpl(trylast=True)
def loaderplug_device_backend(device: str) -> DeviceBackend | None:
    return cuda_backend(device)
