"""Walking a model folder: regular files, relative symlinks that stay inside, and refusals.

A Hugging Face cache keeps content in ``blobs/`` and points ``snapshots/<rev>/<name>``
at it with relative symlinks; those must round-trip as symlinks. A symlink that escapes
the tree, or a special file (FIFO, socket, device), is refused and reported: copying it
would either reach outside the model or block forever. Whether a link escapes is found
by following the links actually in the tree (:mod:`loaderplug.storage.link_targets`),
never by its text alone: a ``..`` after a link climbs from the link's target.
"""

from __future__ import annotations

import os
import posixpath
import stat
from dataclasses import dataclass, field
from pathlib import Path

from loaderplug.errors import MirrorError
from loaderplug.jobs.file_sink import is_temp_name
from loaderplug.storage.link_targets import refused_links

LOCK_NAME = ".loaderplug.lock"
FILE_LOCK_SUFFIX = ".loaderplug-lock"
MANIFEST_NAME = ".loaderplug-manifest.json"
SYNC_MARK_NAME = ".loaderplug-sync"  # see sync_mark
_OWN_NAMES = frozenset({LOCK_NAME, MANIFEST_NAME, SYNC_MARK_NAME})


def lock_name_for(name: str) -> str:
    """The name of the lock file of the file ``name``."""
    return f".{name}{FILE_LOCK_SUFFIX}"


def is_own_name(name: str) -> bool:
    """loaderplug's bookkeeping files, never copied as part of a model."""
    return (
        name in _OWN_NAMES
        or is_temp_name(name)
        or name.startswith(MANIFEST_NAME + ".")
        or name.startswith(SYNC_MARK_NAME + ".")
        or (name.startswith(".") and name.endswith(FILE_LOCK_SUFFIX))
    )


@dataclass
class Tree:
    """What a walk found, by path relative to the root (POSIX separators)."""

    files: dict[str, os.stat_result] = field(default_factory=dict)
    symlinks: dict[str, str] = field(default_factory=dict)
    dirs: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


def symlink_problem(rel: str, target: str) -> str | None:
    """Why a symlink at ``rel`` pointing at ``target`` cannot be recreated by its text
    alone, or None. A first look at a link named in a listing: the links it passes
    through are followed when it is placed (:func:`loaderplug.jobs.placing.place_symlinks`)."""
    if posixpath.isabs(target):
        return f"symlink to an absolute path ({target}) is refused; only relative links are kept"
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    if resolved == ".." or resolved.startswith("../"):
        return f"symlink to {target} escapes the tree and is refused"
    return None


def path_problem(rel: str) -> str | None:
    """Why a relative path from a manifest cannot be trusted, or None."""
    if not rel or posixpath.isabs(rel) or rel.startswith("\\"):
        return f"path {rel!r} is absolute or empty and is refused"
    normalized = posixpath.normpath(rel)
    if normalized == ".." or normalized.startswith("../") or normalized != rel:
        return f"path {rel!r} escapes the mirror root or is not normalized, and is refused"
    return None


def walk(root: Path) -> Tree:
    """Everything under ``root``, without following symlinks; a link is kept if,
    followed through the tree's other links, it stays inside."""
    tree = Tree()
    links: dict[str, str] = {}
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        folder = root / rel_dir if rel_dir else root
        try:
            entries = os.scandir(folder)
        except OSError as exc:
            raise MirrorError(
                f"cannot list {folder}: {exc.strerror or exc}; check its permissions"
            ) from exc
        with entries:
            for entry in entries:
                if is_own_name(entry.name):
                    continue
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    links[rel] = os.readlink(entry.path)
                elif stat.S_ISDIR(st.st_mode):
                    tree.dirs.append(rel)
                    pending.append(rel)
                elif stat.S_ISREG(st.st_mode):
                    tree.files[rel] = st
                else:
                    tree.refused[rel] = "special file (device, FIFO or socket) is refused"
    # Judged together, once the whole tree is known: a link's meaning depends on others.
    refused = refused_links(links)
    tree.refused.update(refused)
    tree.symlinks = {rel: target for rel, target in links.items() if rel not in refused}
    return tree


def temp_files(root: Path) -> list[Path]:
    """Temp files a killed run left behind under ``root``."""
    found: list[Path] = []
    for dirpath, _dirnames, filenames in os.walk(root):
        found.extend(Path(dirpath) / name for name in filenames if is_temp_name(name))
    return found
