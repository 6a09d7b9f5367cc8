"""What a job places besides copies: the destination's checks, folders and symlinks."""

from __future__ import annotations

import errno
import os
import posixpath
from pathlib import Path

from loaderplug.errors import DestinationError
from loaderplug.jobs.file_sink import temp_name_for
from loaderplug.storage.files import replace_with_link
from loaderplug.types import FileResult

# A destination that cannot take a lock file: a read-only filesystem or folder.
READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def check_destination(job: str, destination: Path) -> None:
    """A destination must be a folder, or not exist yet under folders."""
    for folder in (destination, *destination.parents):
        if folder.exists() and not folder.is_dir():
            where = "is" if folder == destination else f"is under {folder}, which is"
            raise DestinationError(
                f"{job} destination {destination} {where} a file, not a folder; "
                f"pick a folder (or remove the file)"
            )
        if folder.exists():
            return


def check_nothing_to_write(job: str, destination: Path | None, stale: list[str], why: str) -> None:
    """A read-only destination serves a job only if every copy there is current."""
    if stale:
        shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise DestinationError(
            f"{job} destination {destination} cannot be written ({why}) and "
            f"{len(stale)} file(s) there are missing or out of date: {shown}"
        )


def make_dirs(root: Path | None, dirs: list[str]) -> list[FileResult]:
    """Create the source's folders (empty ones included); a clash is that path's failure."""
    failures: list[FileResult] = []
    if root is None:
        return failures
    for rel in dirs:
        try:
            (root / rel).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reason = f"cannot create the folder: {exc.strerror or exc}"
            failures.append(FileResult(rel, "failed", reason=reason, errno=exc.errno))
    return failures


def place_symlink(root: Path, rel: str, target: str, failed: set[str]) -> FileResult:
    """Recreate one relative symlink, unless what it points at failed to copy."""
    pointee = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    if pointee in failed:
        return FileResult(rel, "failed", reason=f"not linked: its target {pointee} failed to copy")
    dst = root / rel
    try:
        if os.path.islink(dst) and os.readlink(dst) == target:
            return FileResult(rel, "skipped")
        dst.parent.mkdir(parents=True, exist_ok=True)
        replace_with_link(dst, target, temp=temp_name_for(dst))
    except OSError as exc:
        return FileResult(rel, "failed", reason=f"cannot create symlink: {exc}", errno=exc.errno)
    return FileResult(rel, "linked")
