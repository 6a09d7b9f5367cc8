"""The mirror's manifest: every synced file with its size and mtime, written last.

``sync`` writes the manifest after every file landed or failed, atomically (temp +
rename). It records each file's size and mtime *as the mirror shows them*, and lists the
files whose sync failed as ``incomplete``, so nothing is dropped silently. ``hydrate``
then trusts it over a walk: a file whose size or mtime disagrees (a sync under way, or
one that landed after the manifest was written) is refused rather than copied half-new,
and an incomplete file is reported as failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loaderplug.engine.retry import RetryPolicy, as_raised, retrying
from loaderplug.errors import MirrorError
from loaderplug.jobs.file_sink import temp_name_for
from loaderplug.jobs.model_folder import MANIFEST_NAME, path_problem, symlink_problem
from loaderplug.storage.files import write_atomically

VERSION = 1


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
        text, _ = retrying(lambda: path.read_text(encoding="utf-8"), retry, as_raised)
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
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
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise MirrorError(
            f"manifest {path} is malformed ({exc}); run `loaderplug sync` again to rewrite it"
        ) from exc
    return manifest


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
