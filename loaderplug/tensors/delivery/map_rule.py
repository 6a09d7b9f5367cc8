"""Which files a load hands over as tensors over a mapping of the file, and why.

A mapping is the fastest way to tensors of a file read through the page cache: they
share the page cache's pages, no byte is copied and no fresh memory is zeroed
(``safetensors.torch.load_file`` maps every file). Its price: a tensor over a mapping of
a file that someone truncates kills the process that touches it (SIGBUS). So, with
``LOADERPLUG_OWNED=auto``, a load maps a file only where it stays put while the load
and its tensors live:

- loaderplug's own published local copies, which nothing rewrites in place (a copy is
  replaced by a rename, never truncated);
- a user's file on a local filesystem (:data:`~loaderplug.storage.mounts.LOCAL_TYPES`):
  only a process of this machine changes it, and the guarantee is stock safetensors'
  (a file truncated under its tensors can kill the process).

and only where it is read through the page cache: in memory already (page cache,
tmpfs), or cold on a mount where buffered reads are as fast as direct ones (the IO
policy says so; the readers then ask for its pages ahead of the consumer's touches). A
cold file the policy reads with O_DIRECT is read into memory of the load's own, at the
disk's speed. So is every file that can change under the load: one on a network,
cluster or FUSE filesystem (another host, or a server, may change it at any time), one
of the mirror (a sync rewrites it), a file being written (a temp name). ``own`` owns
every file; ``map`` maps every file a load reads in place, wherever it lives.

Ranks sharing a load keep the rule they had: only own local copies in memory are
mapped; the rest reaches the other ranks as their sharing mode says.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loaderplug.jobs.file_sink import is_temp_name
from loaderplug.settings import Settings
from loaderplug.storage.mounts import is_local_type, is_network_type
from loaderplug.types import IOPolicy, Owned


@dataclass(frozen=True)
class MapRule:
    """A load's rule: ``owned`` (``LOADERPLUG_OWNED``), the folders of loaderplug's own
    published local copies, the mirror's folder, and whether ranks share the load
    (``shared_by_ranks``: only own local copies in memory are mapped then)."""

    owned: Owned = "auto"
    own_copies: tuple[Path, ...] = ()  # each resolved to its real path when asked about
    mirror: Path | None = None
    shared_by_ranks: bool = False

    @staticmethod
    def of(
        settings: Settings, local: Path | None = None, *, shared_by_ranks: bool = False
    ) -> MapRule:
        """The rule of a load with ``settings`` (``local``: a one pass's folder, where it
        publishes own copies)."""
        folders: Sequence[Path] = (settings.local_models_dir, *([local] if local else []))
        return MapRule(
            owned=settings.owned,
            own_copies=tuple(folders),
            mirror=Path(settings.mirror) if settings.mirror else None,
            shared_by_ranks=shared_by_ranks,
        )

    def why_mapped(self, path: Path, policy: IOPolicy, in_memory: bool) -> str | None:
        """Why ``path`` (read in place under ``policy``; ``in_memory``: its bytes are in
        the page cache or on tmpfs) is mapped, or None: its bytes are to be owned."""
        if self.shared_by_ranks:
            return "an own local copy" if in_memory and self.is_own_copy(path) else None
        if self.owned != "auto":
            return "LOADERPLUG_OWNED=map" if self.owned == "map" else None
        real = _RealOnce(path)
        if self.is_own_copy(path, real):
            what = "an own local copy"
        elif self._stays_put(path, policy, real):
            what = f"a file on {policy.fs_type}, a local filesystem"
        else:
            return None
        if in_memory:
            return what
        # Cold: through the page cache where the policy reads it so, else owned.
        if not shares_page_cache(policy):
            return None
        return f"{what}, read through the page cache"

    def is_own_copy(self, path: Path, real: _RealOnce | None = None) -> bool:
        """Whether ``path`` is one of loaderplug's own published local copies, which
        nothing rewrites in place: a copy is replaced by a rename, never truncated."""
        if not self.own_copies or is_temp_name(path.name):
            return False
        real = real or _RealOnce(path)
        return any(_within(real, folder) for folder in self.own_copies)

    def _stays_put(self, path: Path, policy: IOPolicy, real: _RealOnce) -> bool:
        """A user's file that only a process of this machine changes: on a local
        filesystem, and not the mirror's (a sync rewrites it) nor a file being written
        (a temp name)."""
        if not is_local_type(policy.fs_type) or is_temp_name(path.name):
            return False
        return self.mirror is None or not _within(real, self.mirror)


def shares_page_cache(policy: IOPolicy) -> bool:
    """Whether reads under ``policy`` go through a page cache other processes can map:
    not direct, and not a network filesystem's (one other hosts' writes do not keep
    whole)."""
    return not policy.direct and not is_network_type(policy.fs_type)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


class _RealOnce:
    """A path's real path, resolved the first time it is asked for, and once."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._real: str | None = None

    @property
    def path(self) -> str:
        if self._real is None:
            self._real = os.path.realpath(self._path)
        return self._real


def _within(real: _RealOnce, folder: Path) -> bool:
    """Whether a file's real path lies in ``folder`` (its real path, that is), with no
    path made (a load asks it of every file). A folder that does not exist holds no
    file: the file's real path is not even asked for."""
    resolved = _real_folder(folder)
    if resolved is None:
        return False
    base, path = str(resolved), real.path
    return path == base or path.startswith(base if base.endswith(os.sep) else base + os.sep)


# Each folder's real path, with the identity of the folder it named then: a load asks
# for its rule's folders, and one whose name now leads elsewhere is resolved again.
_folders: dict[str, tuple[tuple[int, int], Path]] = {}


def _real_folder(folder: Path) -> Path | None:
    key = os.fspath(folder)
    try:
        st = os.stat(key)
    except OSError:
        return None
    seen = (st.st_dev, st.st_ino)
    known = _folders.get(key)
    if known is not None and known[0] == seen:
        return known[1]
    real = _real(folder)
    _folders[key] = (seen, real)
    return real
