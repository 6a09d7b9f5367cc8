"""The mirror's manifest: every synced file with its size and mtime, written last.

``sync`` writes the manifest after every file landed or failed, atomically (temp +
rename). It records each file's size and mtime *as the mirror shows them*, and lists the
files whose sync failed as ``incomplete``, so nothing is dropped silently. ``hydrate``
then trusts it over a walk: a file whose size or mtime disagrees (a sync under way, or
one that landed after the manifest was written) is refused rather than copied half-new,
and an incomplete file is reported as failed.

The manifest lies on a shared volume: it is read only as a regular file (never through
a link, never a FIFO or a device) and only up to a size scaled to the model it lists,
:data:`BASE_BYTES` plus :data:`ENTRY_BYTES` for each file, link and folder of the
mirror (counted only when the manifest is larger than the base, and only as far as its
size needs). A manifest larger than its mirror can justify is refused, not read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loaderplug.engine.retry import GiveUp, RetryPolicy, as_raised, retrying
from loaderplug.errors import MirrorError
from loaderplug.jobs.file_sink import temp_name_for
from loaderplug.jobs.model_folder import MANIFEST_NAME, path_problem, symlink_problem
from loaderplug.storage.files import write_atomically
from loaderplug.storage.state_files import UnsafeFile, read_capped
from loaderplug.units import KiB

VERSION = 1
# The size cap: a manifest entry takes about 70 bytes and its path (with indent=1), so
# 1 KiB an entry leaves room for long paths, and the base for a few hundred files.
BASE_BYTES = 64 * KiB
ENTRY_BYTES = 1 * KiB


@dataclass
class Manifest:
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # rel → (size, mtime_ns)
    symlinks: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # rel → why it is not hydrated


# A manifest is read like any file of the mirror: with the default retry policy.
READ_RETRY = RetryPolicy()


def read(root: Path, retry: RetryPolicy = READ_RETRY) -> Manifest | None:
    """The manifest at ``root``, or None when the mirror has none (it is then walked).
    A transient error (a stale NFS handle, EIO under load) is retried like any read."""
    path = root / MANIFEST_NAME
    try:
        raw, _ = retrying(lambda: _read_capped(root, path), retry, _cannot_read(path))
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"expected an object with version {VERSION}")
        manifest = Manifest()
        for rel, entry in data.get("files", {}).items():
            size, mtime_ns = int(entry["size"]), int(entry["mtime_ns"])
            problem = path_problem(rel)
            if problem:
                manifest.refused[rel] = problem
            else:
                manifest.files[rel] = (size, mtime_ns)
        for rel, target in data.get("symlinks", {}).items():
            problem = path_problem(rel) or symlink_problem(rel, str(target))
            if problem:
                manifest.refused[rel] = problem
            else:
                manifest.symlinks[rel] = str(target)
        for rel, reason in data.get("incomplete", {}).items():
            manifest.refused[rel] = (
                f"the last sync of this file to the mirror failed ({reason}); "
                f"run `loaderplug sync` again"
            )
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # UTF-8 errors too
        raise MirrorError(
            f"manifest {path} is malformed ({exc}); run `loaderplug sync` again to rewrite it"
        ) from exc
    return manifest


def _read_capped(root: Path, path: Path) -> bytes:
    size = os.lstat(path).st_size
    return read_capped(path, size_cap(root, size), "the manifest of this mirror")[0]


def _cannot_read(path: Path) -> GiveUp:
    """A manifest that is not a regular file, or too large, is a MirrorError at once;
    other errors are raised as they were (FileNotFoundError: no manifest)."""

    def give_up(exc: OSError, attempts: int | None) -> Exception:
        if isinstance(exc, UnsafeFile):
            return MirrorError(
                f"manifest {path}: {exc.strerror}; run `loaderplug sync` again to rewrite it"
            )
        return as_raised(exc, attempts)

    return give_up


def size_cap(root: Path, size: int) -> int:
    """The most bytes the manifest of the mirror ``root`` may hold, found out as far as
    a manifest of ``size`` bytes needs: :data:`BASE_BYTES`, and :data:`ENTRY_BYTES`
    for each entry of the mirror's tree (links not followed), counted until ``size``
    fits or the tree ends."""
    cap = BASE_BYTES
    pending = [root]
    while pending and cap < size:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    cap += ENTRY_BYTES
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(Path(entry.path))
        except (NotADirectoryError, FileNotFoundError, PermissionError):
            continue  # changed under the count, or unreadable: counts as nothing
    return cap


def write(
    root: Path,
    files: dict[str, tuple[int, int]],
    symlinks: dict[str, str],
    incomplete: dict[str, str],
) -> Path:
    """Write the manifest atomically and durably; returns its path.

    ``files`` maps each path to (size, mtime_ns) as the mirror shows it; ``incomplete``
    maps each path whose sync failed to the reason.
    """
    payload: dict[str, Any] = {
        "version": VERSION,
        "files": {
            rel: {"size": size, "mtime_ns": mtime} for rel, (size, mtime) in sorted(files.items())
        },
        "symlinks": dict(sorted(symlinks.items())),
        "incomplete": dict(sorted(incomplete.items())),
    }
    path = root / MANIFEST_NAME
    # Under a loaderplug temp name: swept like any other if this process dies.
    write_atomically(path, json.dumps(payload, indent=1), temp=temp_name_for(path), fsync=True)
    return path
