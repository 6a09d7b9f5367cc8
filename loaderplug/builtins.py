"""Built-in behaviour, registered as a plugin so a third-party plugin can replace it."""

from __future__ import annotations

from pathlib import Path

from loaderplug import fs
from loaderplug.hookspecs import hookimpl
from loaderplug.settings import from_env
from loaderplug.source import PosixSource, Source
from loaderplug.volume import MirrorRequest


@hookimpl(trylast=True)
def loaderplug_find_mirror(request: MirrorRequest) -> Path | None:
    volume = from_env().volume
    if not volume:
        return None
    candidate = Path(volume) / request.subpath
    if request.kind == "hub":
        # The Hub layout's root: its repos are looked up (and created) inside it.
        return candidate if Path(volume).is_dir() else None
    return candidate if candidate.exists() else None


@hookimpl(trylast=True)
def loaderplug_io_policy(path: str, mode: str) -> fs.IOPolicy:
    return fs.decide(path, mode)


@hookimpl(trylast=True)
def loaderplug_open_source(path: str, policy: fs.IOPolicy) -> Source:
    return PosixSource(path, policy)
