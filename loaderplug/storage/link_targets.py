"""Where a symlink in a tree leads, found as the kernel finds it.

The text of a target says little: a ``..`` after a link climbs from the link's target,
not from where the link sits, so ``a/b/up -> ../..`` followed by ``a/b/esc -> up/..``
reads as inside and leads out. A target is judged here by walking it name by name and
following every link actually on the way (the rule of Python's tarfile ``data`` filter
and of GNU tar): a ``..`` above the tree's root, an absolute target anywhere on the way,
or more links than the kernel follows (a loop) is refused. A name that is not a link (a
folder, a file, or nothing yet) is taken as a plain name, as ``realpath`` takes a
missing one; only links change where a path leads, so a set of links is judged
together (:func:`refused_links`), each against the others as they will be.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loaderplug.storage.safe_paths import is_link_at, parent_below

# The target of the link at a path relative to the root (POSIX separators), or None
# where that path is not a link.
LinksAt = Callable[[str], str | None]

MAX_LINKS = 40  # the kernel's limit on links followed for one path (ELOOP)
MAX_NAMES = 16384  # names walked for one link: far past any model's, and bounded


@dataclass
class Followed:
    """What following one link found: why it is refused (None: it stays inside), and
    the links on its way, whose change may change the answer."""

    problem: str | None = None
    through: set[str] = field(default_factory=set)


def follow(links_at: LinksAt, rel: str, target: str) -> Followed:
    """Follow the link at ``rel`` (relative to the root) whose target is ``target``."""
    done = Followed()
    if target.startswith("/"):
        done.problem = (
            f"symlink to an absolute path ({target}) is refused; only relative links are kept"
        )
        return done
    where = rel.split("/")[:-1]  # the link's folder: a relative target starts there
    pending = target.split("/")[::-1]  # names left, next one last
    via = ""
    hops = walked = 0
    while pending:
        name = pending.pop()
        walked += 1
        if name in ("", "."):
            continue
        if name == "..":
            if not where:
                done.problem = _escapes(target, via, links_at)
                return done
            where.pop()
            continue
        here = "/".join([*where, name])
        next_target = links_at(here)
        if next_target is None:
            where.append(name)
        elif next_target.startswith("/"):
            done.problem = (
                f"symlink to {target} leads through the link {here} -> {next_target}, an "
                f"absolute path, and is refused"
            )
            return done
        else:
            done.through.add(here)
            via, hops = here, hops + 1
            pending.extend(next_target.split("/")[::-1])
        if hops > MAX_LINKS or walked > MAX_NAMES:
            done.problem = (
                f"symlink to {target} cannot be followed (a loop, or more than "
                f"{MAX_LINKS} links on its way) and is refused"
            )
            return done
    return done


def _escapes(target: str, via: str, links_at: LinksAt) -> str:
    if not via:
        return f"symlink to {target} escapes the tree and is refused"
    return (
        f"symlink to {target} escapes the tree once the link {via} -> {links_at(via)} on "
        f"its way is followed, and is refused"
    )


def refused_links(links: Mapping[str, str], others: LinksAt = lambda rel: None) -> dict[str, str]:
    """The links of ``links`` (path -> target) that lead out of the tree, with why,
    judged together: a refused link is not there for the others (it will not be made),
    which may refuse more. ``others`` gives the links already in the tree that
    ``links`` does not name."""
    live = dict(links)
    refused: dict[str, str] = {}

    def links_at(rel: str) -> str | None:
        return live.get(rel) if rel in links else others(rel)

    followed = {rel: follow(links_at, rel, target) for rel, target in live.items()}
    while True:
        dropped = {rel: f.problem for rel, f in followed.items() if f.problem}
        if not dropped:
            return refused
        for rel in dropped:
            del live[rel], followed[rel]
        refused.update(dropped)
        # Only a link that went through a dropped one can change its answer.
        for rel, f in list(followed.items()):
            if f.through & dropped.keys():
                followed[rel] = follow(links_at, rel, live[rel])


def links_in(root: Path) -> LinksAt:
    """The links actually under ``root``, looked up as they are asked for (a path
    whose folder on the way is itself a link is not looked through)."""
    known: dict[str, str | None] = {}

    def links_at(rel: str) -> str | None:
        if rel not in known:
            known[rel] = _read_link(root, rel)
        return known[rel]

    return links_at


def _read_link(root: Path, rel: str) -> str | None:
    try:
        with parent_below(root, root / rel) as (fd, name):
            return os.readlink(name, dir_fd=fd) if is_link_at(fd, name) else None
    except (OSError, ValueError):
        return None  # missing, or under a link: nothing to follow there


def all_links(root: Path) -> dict[str, str]:
    """Every symlink under ``root`` (path -> target), without following any."""
    found: dict[str, str] = {}
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        try:
            entries = list(os.scandir(root / rel_dir if rel_dir else root))
        except OSError:
            continue  # a folder that cannot be listed holds nothing this job made
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.is_symlink():
                found[rel] = os.readlink(entry.path)
            elif entry.is_dir(follow_symlinks=False):
                pending.append(rel)
    return found
