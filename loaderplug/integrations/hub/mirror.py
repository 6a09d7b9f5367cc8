"""Hub repos on the mirror, in the Hub's own cache layout, and copies in both directions.

``<mirror>/models--org--name/`` is laid out exactly as ``$HF_HOME/hub/models--org--name/``
(so a volume that once served as ``HF_HOME`` is a mirror already)::

    blobs/<etag>                          file contents, named by sha256 (LFS) or git sha1
    snapshots/<commit>/<path>             relative symlinks to ../../blobs/<etag>
    refs/<branch>                         the commit a branch pointed at
    trees/<commit>.json                   the repo's complete file listing at that commit

and, as huggingface_hub >= 2.x writes a cache, a Xet-backed file's ``blobs/<etag>`` may
be a relative link into the cache-wide store beside the repo folders::

    <hub root>/blobs/.huggingface-shared-blobs      the store's marker
    <hub root>/blobs/<2 hex>/<xet hash>             the content, once per cache
    <hub root>/blobs/<2 hex>/<xet hash>.refs        the links that use it

Such a link is followed only where huggingface_hub's own functions say it is one of its
store links (:func:`blob_origin`); any other link is refused. Copies read a blob's bytes
where they are, so every copy's source root is the hub root, and write plain blobs.

The listing is what makes a mirror trustworthy: it names every file of the commit with
its size and etag, so a hydrate knows whether the mirror holds everything a call's
patterns select, and refuses a blob whose size or content does not match its name.
A mirror written before huggingface_hub kept listings has none: :func:`write_listing`
adds one (fetched by the caller) in huggingface_hub's own format, and
:func:`snapshot_selection` reads what a snapshot's links hold where no listing can be had.
Blobs are copied by the range engine (:func:`loaderplug.jobs.copies.select`), their hashes
checked in the same pass (:mod:`loaderplug.jobs.digest`) before they are published, and the
snapshot links follow them; a ref is written last, so a reader that finds it finds the
whole snapshot.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loaderplug.errors import MirrorError
from loaderplug.integrations.hub.names import ref_problem

# The formats huggingface_hub writes (pure data: this module never imports huggingface_hub).
from loaderplug.integrations.upstream import huggingface_hub as seam
from loaderplug.integrations.upstream.huggingface_hub import LISTING_FORMAT, LOCAL_DIR_META
from loaderplug.jobs.copies import select
from loaderplug.jobs.digest import Expected
from loaderplug.jobs.model_folder import is_own_name, path_problem
from loaderplug.report import TransferReport
from loaderplug.settings import Settings
from loaderplug.storage.files import replace_with_link, write_atomically

COMMIT = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
XET_HASH = re.compile(r"^[0-9a-fA-F]{64}$")  # huggingface_hub's check before it writes one
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RepoFile:
    """One file of a commit: its path in the repo, the blob that holds it, its size."""

    path: str
    blob: str
    size: int


def resolve_commit(folder: Path, revision: str) -> str | None:
    """The commit ``revision`` names in the cache ``folder``: itself if it is one, else
    what ``refs/<revision>`` says, else None."""
    if COMMIT.match(revision):
        return revision
    if ref_problem(revision):
        return None  # not a file under refs/: never read from elsewhere
    try:
        commit = (folder / "refs" / revision).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if COMMIT.match(commit) else None


def listing_rel(commit: str) -> str:
    return f"trees/{commit}.json"


NO_LISTING = "it holds no file listing of the commit"


def inspect_listing(folder: Path, commit: str) -> tuple[dict[str, RepoFile] | None, str]:
    """Every file of ``commit`` from the folder's ``trees/<commit>.json`` and "", or None
    and why not: :data:`NO_LISTING` where there is none, else what is wrong with it."""
    rel = listing_rel(commit)
    try:
        data = json.loads((folder / rel).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, NO_LISTING
    except (OSError, ValueError) as exc:
        return None, f"its listing {rel} cannot be read ({exc})"
    files, problem = parse_listing(data)
    return files, (f"its listing {rel} {problem}" if problem else "")


def parse_listing(data: object) -> tuple[dict[str, RepoFile] | None, str]:
    """The files of a listing in huggingface_hub's format (``{"format_version": 1,
    "files": {path: entry}}``) and "", or None and what is wrong with it."""
    try:
        if not isinstance(data, dict) or data.get("format_version") != LISTING_FORMAT:
            version = data.get("format_version") if isinstance(data, dict) else None
            return None, f"is of format {version!r}, not {LISTING_FORMAT}"
        files = {}
        for path, entry in data["files"].items():
            # The blob is named by the ETag the Hub serves: the LFS sha256, else the git
            # blob id; an LFS entry's size is the LFS object's.
            blob = str(entry.get("lfs_sha256") or entry["blob_id"])
            size = entry.get("lfs_size") or entry["size"]
            if path_problem(path) or not (SHA256.match(blob) or COMMIT.match(blob)):
                # A listing that names a path outside the snapshot, or a blob that is not
                # a hash, was not written by huggingface_hub: the mirror is not trusted.
                return None, f"names {path!r} -> {blob!r}, which huggingface_hub never writes"
            files[path] = RepoFile(path, blob, int(size))
        return files, ""
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"is malformed ({type(exc).__name__}: {exc})"


def read_listing(folder: Path, commit: str) -> dict[str, RepoFile] | None:
    """Every file of ``commit`` from the folder's ``trees/<commit>.json``, or None when
    there is no usable listing (absent, unreadable, or of an unknown format)."""
    files, problem = inspect_listing(folder, commit)
    if files is None and problem != NO_LISTING:
        log.warning("%s: refusing the listing of commit %s: %s", folder, commit, problem)
    return files


def listing_differences(mirror: dict[str, RepoFile], hub: dict[str, RepoFile]) -> dict[str, str]:
    """Where the mirror's listing of a commit departs from the Hub's: each path whose
    entry differs, and how."""
    differences = {}
    for path in sorted(set(mirror) | set(hub)):
        ours, theirs = mirror.get(path), hub.get(path)
        if ours == theirs:
            continue
        if theirs is None:
            differences[path] = "not a file of the commit"
        elif ours is None:
            differences[path] = "missing from the mirror's listing"
        else:
            differences[path] = (
                f"the mirror lists blob {ours.blob} of {ours.size} bytes, "
                f"the Hub {theirs.blob} of {theirs.size} bytes"
            )
    return differences


def listing_entry(
    size: int,
    blob_id: str,
    lfs_sha256: str | None = None,
    lfs_size: int | None = None,
    xet_hash: str | None = None,
) -> dict[str, object]:
    """One file's entry of ``trees/<commit>.json``, as huggingface_hub writes it (its keys
    in its order: the listing is byte for byte what huggingface_hub would have written)."""
    entry: dict[str, object] = {"size": size, "blob_id": blob_id}
    if lfs_sha256 is not None:
        entry["lfs_sha256"] = lfs_sha256
        entry["lfs_size"] = lfs_size
    if xet_hash is not None:
        entry["xet_hash"] = xet_hash
    return entry


def write_listing(
    folder: Path, commit: str, entries: dict[str, dict[str, object]], *, fsync: bool = True
) -> bool:
    """Write ``trees/<commit>.json`` into ``folder`` as huggingface_hub writes it (sorted
    paths, ``indent=1``), atomically: a reader finds the old file, none, or the whole new
    one. False (nothing written) where an entry's Xet hash is not one, as huggingface_hub
    itself then writes nothing; ``OSError`` where the folder cannot take it."""
    if any(
        e.get("xet_hash") is not None and not XET_HASH.match(str(e["xet_hash"]))
        for e in entries.values()
    ):
        return False
    data = {"format_version": LISTING_FORMAT, "files": {p: entries[p] for p in sorted(entries)}}
    path = folder / listing_rel(commit)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not a loaderplug temp name: a copy running under the folder's lock sweeps those.
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.listing")
    write_atomically(path, json.dumps(data, indent=1), temp=temp, fsync=fsync)
    return True


def link_target(path: str, blob: str) -> str:
    """The relative target of ``snapshots/<commit>/<path>``, as huggingface_hub makes it."""
    return "../" * (path.count("/") + 2) + f"blobs/{blob}"


def blob_expectation(blob: str, size: int) -> Expected | None:
    """What a blob's content must hash to, by its name: a sha256 name is the content's
    sha256, a git blob id the git hash of it (sha1 over ``blob <size>\\0`` then the
    content). Other names are not checked."""
    if SHA256.match(blob):
        return Expected("sha256", blob)
    if COMMIT.match(blob):
        return Expected("sha1", blob, b"blob %d\0" % size)
    return None


def expectations(by_rel: dict[str, RepoFile]) -> Callable[[str], Expected | None]:
    """The check of each copied file that is a blob, by its destination path."""

    def expect(rel: str) -> Expected | None:
        entry = by_rel.get(rel)
        return blob_expectation(entry.blob, entry.size) if entry is not None else None

    return expect


def blob_origin(folder: Path, blob: str) -> tuple[str | None, str]:
    """Where the bytes of the repo folder's ``blobs/<blob>`` are, relative to the hub
    root (``folder.parent``), and "": the blob itself, or, for a link into the cache's
    shared Xet store, the store file it names. None and why, where it cannot be read."""
    path = folder / "blobs" / blob
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None, "its blob is not there"
    if stat.S_ISREG(mode):
        return f"{folder.name}/blobs/{blob}", ""
    if not stat.S_ISLNK(mode):
        return None, "its blob is not a file"
    root = folder.parent
    target = None
    if seam.is_shared_blobs_dir()(seam.shared_blobs_dir()(root)):
        target = seam.shared_blob_target()(path, root)
    if target is None:
        return None, (
            f"its blob is a link to {os.readlink(path)}, which is not a file of the "
            f"cache's shared blob store ({root / 'blobs'})"
        )
    return target.relative_to(root).as_posix(), ""


@dataclass
class Selection:
    """What a call asks of the mirror at one commit: files it holds, files it cannot give,
    and where each usable blob's bytes are (relative to the hub root)."""

    commit: str
    usable: list[RepoFile]
    refused: dict[str, str]  # repo path -> why the mirror cannot serve it
    origins: dict[str, str] = field(default_factory=dict)  # blob -> its bytes' path

    def use(self, entry: RepoFile, origin: str) -> None:
        self.usable.append(entry)
        self.origins[entry.blob] = origin


def check_selection(
    folder: Path, commit: str, wanted: Sequence[str], listing: dict[str, RepoFile]
) -> Selection:
    """Check each wanted file's blob on the mirror against the listing, by size."""
    selection = Selection(commit, [], {})
    for path in wanted:
        entry = listing[path]
        origin, problem = blob_origin(folder, entry.blob)
        try:
            size = os.stat(folder.parent / origin).st_size if origin else -1
        except OSError:
            origin, problem = None, "its blob is not there"
        if origin is None:
            selection.refused[path] = problem.replace("there", "on the mirror", 1)
            continue
        if size != entry.size:
            selection.refused[path] = (
                f"its blob on the mirror has {size} bytes; the listing says {entry.size}"
            )
            continue
        selection.use(entry, origin)
    return selection


def snapshot_selection(
    folder: Path, commit: str, choose: Callable[[Iterable[str]], Iterable[str]]
) -> Selection:
    """What the folder's ``snapshots/<commit>/`` holds of the paths ``choose`` keeps, for a
    folder with no listing of the commit (written before huggingface_hub kept one): each
    link into the folder's ``blobs/`` whose blob is there, at the blob's size. Nothing
    says the snapshot is complete; a blob named by a hash is still checked as it is
    copied. A regular file, a link elsewhere or a missing blob is refused."""
    root = folder / "snapshots" / commit
    found: dict[str, Path] = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if is_own_name(name):
                continue
            where = Path(dirpath, name)
            found[where.relative_to(root).as_posix()] = where
    blobs = os.path.normpath(os.path.abspath(folder / "blobs"))
    selection = Selection(commit, [], {})
    for path in choose(sorted(found)):
        where = found[path]
        problem = path_problem(path)
        if problem:
            selection.refused[path] = problem
            continue
        if not where.is_symlink():
            selection.refused[path] = "it is not a link to a blob on the mirror"
            continue
        target = os.path.normpath(os.path.join(os.path.abspath(where.parent), os.readlink(where)))
        blob = os.path.basename(target)
        if os.path.dirname(target) != blobs or not (SHA256.match(blob) or COMMIT.match(blob)):
            selection.refused[path] = f"its link points at {os.readlink(where)}, not at a blob"
            continue
        origin, problem = blob_origin(folder, blob)
        try:
            st = os.stat(folder.parent / origin) if origin else None
        except OSError:
            st = None
        if origin is None or st is None or not stat.S_ISREG(st.st_mode):
            why = problem or "its blob is not there"
            selection.refused[path] = why.replace("there", "on the mirror", 1)
            continue
        selection.use(RepoFile(path, blob, st.st_size), origin)
    return selection


def hydrate_cache(
    mirror: Path, local: Path, selection: Selection, settings: Settings, *, listing: bool = True
) -> TransferReport:
    """Copy the selection into the cache folder ``local`` (Hub layout): blobs, verified
    before they are published, the listing (unless ``listing`` is False: the mirror has
    none), and the snapshot links to what landed. Blobs land as plain files, which
    huggingface_hub reads like its store's links."""
    files = {f"blobs/{f.blob}": selection.origins[f.blob] for f in selection.usable}
    if listing:
        rel = listing_rel(selection.commit)
        files[rel] = f"{mirror.name}/{rel}"
    links = {
        f"snapshots/{selection.commit}/{f.path}": link_target(f.path, f.blob)
        for f in selection.usable
    }
    expect = expectations({f"blobs/{f.blob}": f for f in selection.usable})
    return select("hydrate", mirror.parent, local, files, links, settings, expect=expect)


def hydrate_local_dir(
    mirror: Path,
    local_dir: Path,
    selection: Selection,
    settings: Settings,
    *,
    listing: bool = True,
) -> TransferReport:
    """Copy the selection into ``local_dir`` as plain files at their repo paths, with the
    listing (unless ``listing`` is False) where huggingface_hub keeps it for a
    ``local_dir`` download."""
    files = {f.path: selection.origins[f.blob] for f in selection.usable}
    if listing:
        rel = listing_rel(selection.commit)
        files[f"{LOCAL_DIR_META}/{rel}"] = f"{mirror.name}/{rel}"

    # The lock goes with huggingface_hub's own bookkeeping, not among the user's files.
    return select(
        "hydrate",
        mirror.parent,
        local_dir,
        files,
        {},
        settings,
        expect=expectations({f.path: f for f in selection.usable}),
        lock_in=LOCAL_DIR_META,
    )


def write_ref(folder: Path, revision: str, commit: str, *, fsync: bool) -> None:
    """Point ``refs/<revision>`` at ``commit``, atomically (a reader sees old or new).
    ``ValueError`` for a revision that is no ref name: it would write outside ``refs/``."""
    problem = ref_problem(revision)
    if problem:
        raise ValueError(f"{folder}: no ref written: {problem}")
    ref = folder / "refs" / revision
    if ref.is_file() and ref.read_text().strip() == commit:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    # Not a loaderplug temp name: a copy running under the folder's lock sweeps those.
    temp = ref.with_name(f".{ref.name}.{secrets.token_hex(6)}.ref")
    write_atomically(ref, commit, temp=temp, fsync=fsync)


def link_snapshot(folder: Path, commit: str, files: Iterable[RepoFile]) -> int:
    """Give ``snapshots/<commit>/`` the links it lacks to blobs the folder holds (a new
    commit whose unchanged files were served from the old one's blobs), so stock
    huggingface_hub finds the whole snapshot offline. Each link appears whole (made
    aside, then renamed); returns how many were made."""
    made = 0
    for f in files:
        link = folder / "snapshots" / commit / f.path
        if os.path.lexists(link) or not (folder / "blobs" / f.blob).exists():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        temp = link.with_name(f".{link.name}.{secrets.token_hex(6)}.link")
        replace_with_link(link, link_target(f.path, f.blob), temp=temp)
        made += 1
    return made


def sync_snapshot(
    local: Path,
    mirror: Path,
    commit: str,
    revision: str,
    choose: Callable[[Iterable[str]], Iterable[str]],
    settings: Settings,
    *,
    local_dir: bool = False,
) -> TransferReport:
    """Copy a downloaded snapshot (the paths of ``commit``'s listing that ``choose``
    keeps) to the mirror folder, then the ref last. ``local`` is the repo's cache
    folder, or with ``local_dir`` the folder a ``local_dir`` download filled with plain
    files."""
    meta = f"{LOCAL_DIR_META}/" if local_dir else ""
    listing = read_listing(local / meta, commit)
    if listing is None:
        raise MirrorError(
            f"{local}: no file listing for commit {commit} ({meta}trees/{commit}.json); "
            f"without it the mirror could not tell a complete snapshot, so it is not filled"
        )
    entries = [listing[p] for p in choose(listing)]
    # A cache's blobs are read where their bytes are (its shared store included), from
    # the hub root; a local_dir's files where they are.
    source = local if local_dir else local.parent
    files: dict[str, str] = {}
    for f in entries:
        origin, problem = (f.path, "") if local_dir else blob_origin(local, f.blob)
        # A blob that cannot be read is left to the copy, which reports it as failed.
        files[f"blobs/{f.blob}"] = origin or f"{local.name}/blobs/{f.blob}"
        if problem:
            log.debug("%s: %s: %s", local, f.path, problem)
    rel = listing_rel(commit)
    files[rel] = meta + rel if local_dir else f"{local.name}/{rel}"
    links = {f"snapshots/{commit}/{f.path}": link_target(f.path, f.blob) for f in entries}
    mirror.mkdir(parents=True, exist_ok=True)
    expect = expectations({f"blobs/{f.blob}": f for f in entries})
    report = select("sync", source, mirror, files, links, settings, expect=expect)
    # A name no ref can have (a leftover temp file under the local refs/) publishes
    # the commit alone, as a commit's download does.
    if report.ok and not COMMIT.match(revision) and not ref_problem(revision):
        write_ref(mirror, revision, commit, fsync=settings.fsync)
    return report
