"""The current-copy rule: when a published copy is the file a job would copy, so every
job skips it (a hydrate, a sync, the local copy a load reads instead of the mirror); a
copy of an object also names the version it was made from."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from loaderplug.storage.safe_paths import LinkOnPath, guard_root, lstat_below
from loaderplug.types import Identity, same_mtime


def is_current_copy(dst: Path, identity: Identity, *, root: Path | None = None) -> bool:
    """Whether ``dst`` already holds the file ``identity`` describes: a regular file
    (a symlink there is not followed: it is replaced) of the same size, stamped with the
    same mtime, as every published copy is (as far as its filesystem keeps mtimes: one
    that keeps whole seconds reads a stamp back cut to the second). Below ``root`` no
    link is followed on the way to ``dst``: a copy reached through one is not current
    (it is written where it belongs, or refused)."""
    try:
        st = lstat_below(guard_root(root, dst), dst)
    except (FileNotFoundError, NotADirectoryError, LinkOnPath, ValueError):
        return False
    same = (
        stat.S_ISREG(st.st_mode)
        and st.st_size == identity.size
        and same_mtime(identity.mtime_ns, st.st_mtime_ns)
    )
    # A copy of an object also names the version it was (see tag_version): a store's
    # times are whole seconds, so a replacement of the same size in the same second
    # is told by its ETag. A copy without the tag (a filesystem without user
    # attributes) is judged by size and time alone.
    tagged = _version_of(dst) if same and identity.etag else None
    return same and (tagged is None or tagged == identity.etag)


VERSION_ATTRIBUTE = "user.loaderplug.etag"


def tag_version(fd: int, etag: str) -> None:
    """Name the object version (its ETag) a copy was made from, where the filesystem
    keeps user attributes (nothing otherwise)."""
    with contextlib.suppress(OSError):
        os.setxattr(fd, VERSION_ATTRIBUTE, etag.encode())


def _version_of(path: Path) -> str | None:
    try:
        return os.getxattr(path, VERSION_ATTRIBUTE, follow_symlinks=False).decode()
    except (OSError, UnicodeDecodeError):
        return None
