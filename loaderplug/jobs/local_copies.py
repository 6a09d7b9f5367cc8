"""Local copies of mirrored models: which folders are mirrors, where their copy goes,
and hydrating chosen files of one into it. Shared by every loader integration.

A folder is a mirror when it lives on a network or userspace filesystem, or under the
configured volume; its local copy sits under ``LOADERPLUG_LOCAL_COPIES``, named after the
model and a hash of the mirror's path, so two models that share a name stay apart.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from loaderplug.errors import TransferFailed
from loaderplug.jobs.copies import select
from loaderplug.plugins.manager import Plugins
from loaderplug.settings import Settings
from loaderplug.storage.mounts import is_network_type


def is_mirror(folder: Path, settings: Settings) -> bool:
    """Whether ``folder`` is a mirror to hydrate from, rather than a folder to read."""
    if settings.mirror and folder.is_relative_to(Path(settings.mirror).resolve()):
        return True
    return is_network_type(Plugins(settings).io_policy(folder).fs_type)


def local_copy(folder: Path, settings: Settings, name: str = "") -> Path:
    """Where the local copy of the mirror folder ``folder`` goes."""
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    return settings.local_models_dir / f"{name or folder.name}-{digest}"


def hydrate_copy(folder: Path, names: list[str], copy: Path, settings: Settings) -> None:
    """Hydrate ``names`` of ``folder`` into ``copy`` (a no-op for current files); raises
    :class:`TransferFailed` naming any file that failed."""
    report = select("hydrate", folder, copy, {n: n for n in names}, {}, settings)
    if not report.ok:
        raise TransferFailed(report)
