"""What a job places besides copies: the destination's checks, folders and symlinks.

Folders and links are made below the destination without following a link there
(:mod:`loaderplug.storage.safe_paths`), and a link is placed only if, followed through
the links actually in the tree, it stays inside (:mod:`loaderplug.storage.link_targets`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
from pathlib import Path

from loaderplug.errors import DestinationError
from loaderplug.jobs.file_sink import temp_name_for
from loaderplug.storage.link_targets import all_links, follow, links_in, refused_links
from loaderplug.storage.safe_paths import is_link_at, make_folders, parent_below
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
    """Create the source's folders (empty ones included); a clash is that path's failure.
    A folder on the way that is a symlink is such a clash: nothing is made through it."""
    failures: list[FileResult] = []
    if root is None:
        return failures
    for rel in dirs:
        try:
            make_folders(root, root / rel)
        except (OSError, ValueError) as exc:
            reason = f"cannot create the folder: {getattr(exc, 'strerror', None) or exc}"
            code = exc.errno if isinstance(exc, OSError) else None
            failures.append(FileResult(rel, "failed", reason=reason, errno=code))
    return failures


def place_symlinks(root: Path, links: dict[str, str], failed: set[str]) -> list[FileResult]:
    """Recreate relative symlinks under ``root``, each judged by following the links
    actually in the tree with these placed (a ``..`` after a link climbs from its
    target): one that leads out of ``root`` is refused, and one a stale link of an
    earlier job stands in for is removed. None whose target failed to copy (``failed``),
    or that sits under a path that failed, is placed."""
    results: dict[str, FileResult] = {}
    wanted: dict[str, str] = {}
    for rel, target in sorted(links.items()):
        why = _blocked(rel, target, failed)
        if why:
            results[rel] = FileResult(rel, "failed", reason=why)
        else:
            wanted[rel] = target
    links_at = links_in(root)
    refused = refused_links(wanted, links_at)
    for rel in wanted:  # in order: a folder's link before the links under it
        if rel not in refused and _blocked(rel, "", set(refused)):
            refused[rel] = f"not linked: {rel} is under a refused link"
    # Only a tree whose links change can turn another link outward: the common rerun,
    # every link standing as wanted, walks nothing.
    changes = any(links_at(rel) != (None if rel in refused else t) for rel, t in wanted.items())
    # Links already leading out are not this job's doing; it must add none.
    escaped_before = _escaping(all_links(root)) if changes else {}
    for rel in sorted(wanted):
        if rel in refused:
            results[rel] = FileResult(rel, "failed", reason=refused[rel])
            _remove_link(root, rel)  # an earlier job's link there must not outlive it
        else:
            results[rel] = _place(root, rel, wanted[rel])
    if changes:
        for rel, why in _unlink_new_escapes(root, escaped_before, wanted).items():
            results[rel] = FileResult(rel, "failed", reason=why)
    return [results[rel] for rel in sorted(results)]


def _blocked(rel: str, target: str, failed: set[str]) -> str | None:
    """Why the link at ``rel`` is not placed because of a path that failed, or None."""
    if target:
        pointee = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
        if pointee in failed:
            return f"not linked: its target {pointee} failed to copy"
    parent = posixpath.dirname(rel)
    while parent:
        if parent in failed:
            return f"not linked: {parent}, on its way, failed"
        parent = posixpath.dirname(parent)
    return None


def _place(root: Path, rel: str, target: str) -> FileResult:
    """The link at ``rel``, made aside and renamed into place, in a folder reached
    without following a link."""
    dst = root / rel
    try:
        with parent_below(root, dst, create=True) as (fd, name):
            if is_link_at(fd, name) and os.readlink(name, dir_fd=fd) == target:
                return FileResult(rel, "skipped")
            temp = temp_name_for(dst).name
            os.symlink(target, temp, dir_fd=fd)
            try:
                os.rename(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except BaseException:
                os.unlink(temp, dir_fd=fd)
                raise
    except (OSError, ValueError) as exc:  # ValueError: a NUL in a name
        reason = f"cannot create symlink: {getattr(exc, 'strerror', None) or exc}"
        code = exc.errno if isinstance(exc, OSError) else None
        return FileResult(rel, "failed", reason=reason, errno=code)
    return FileResult(rel, "linked")


def _remove_link(root: Path, rel: str) -> None:
    """Remove the link at ``rel`` if there is one (never a file or folder)."""
    with contextlib.suppress(OSError, ValueError), parent_below(root, root / rel) as (fd, name):
        if is_link_at(fd, name):
            os.unlink(name, dir_fd=fd)


def _unlink_new_escapes(
    root: Path, escaped_before: dict[str, str], placed: dict[str, str]
) -> dict[str, str]:
    """Remove every link that leads out of ``root`` now and did not before this job
    placed its links (one of them changed where it leads), until none is left; the
    removed ones, with why."""
    removed: dict[str, str] = {}
    while True:
        escaping = {
            rel: why
            for rel, why in _escaping(all_links(root)).items()
            if rel not in removed and (rel in placed or rel not in escaped_before)
        }
        if not escaping:
            return removed
        for rel, why in escaping.items():
            _remove_link(root, rel)
            removed[rel] = f"removed: {why}"


def _escaping(links: dict[str, str]) -> dict[str, str]:
    """The links of a tree that lead out of it as they stand, with why."""
    found = {rel: follow(links.get, rel, target).problem for rel, target in links.items()}
    return {rel: why for rel, why in found.items() if why}
