"""The current-copy rule: when a published copy is the file a job would copy, so every
job skips it (a hydrate, a sync, the local copy a load reads instead of the mirror)."""

from __future__ import annotations

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
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_size == identity.size
        and same_mtime(identity.mtime_ns, st.st_mtime_ns)
    )
