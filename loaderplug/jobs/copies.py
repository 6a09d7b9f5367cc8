"""Copy jobs: hydrate (mirror → local disk), sync (local disk → mirror), and a selection
of chosen files (the Hub layout), each a planner for the runner.

A hydrate lists the mirror from its manifest when it has one, else by a walk; a sync
walks the local folder and writes the mirror's manifest last; a selection copies chosen
files, each from a source path of its own, plus chosen symlinks. All three run under the
destination's lock, skip what is current there and report every file
(:mod:`loaderplug.jobs.runner`).
"""

from __future__ import annotations

import os
import posixpath
import stat
from pathlib import Path
from typing import Any

from loaderplug.engine.retry import RetryPolicy
from loaderplug.errors import MirrorError, TransferFailed
from loaderplug.jobs import manifest as manifest_mod
from loaderplug.jobs.file_sink import temps_of
from loaderplug.jobs.locks import folder_lock
from loaderplug.jobs.model_folder import path_problem, symlink_problem, temp_files, walk
from loaderplug.jobs.object_copies import object_hydrate_plan, sync_to_objects
from loaderplug.jobs.plan import Expect, FileEntry, Listing, Plan
from loaderplug.jobs.runner import run
from loaderplug.jobs.sync_mark import SyncMark, wait_for_sync
from loaderplug.report import TransferReport
from loaderplug.settings import Settings, from_env
from loaderplug.storage.object_urls import ObjectURL, is_object_url


def hydrate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    check: bool = True,
    settings: Settings | None = None,
    **overrides: Any,
) -> TransferReport:
    """Copy a model folder from a volume mirror to local disk, range-parallel.

    ``overrides`` are settings by field name (``readers=16``,
    ``span_bytes="16M"``) and win over ``LOADERPLUG_*`` variables. With ``check`` (the
    default) a job with failed files raises :class:`TransferFailed`, whose ``report``
    says what happened to each file; every file that did land is published.
    """
    if is_object_url(src):
        return _copy_objects("hydrate", src, dst, check, settings, overrides)
    return _copy_tree("hydrate", Path(src), Path(dst), check, settings, overrides)


def sync(
    local: str | os.PathLike[str],
    mirror: str | os.PathLike[str],
    *,
    check: bool = True,
    settings: Settings | None = None,
    **overrides: Any,
) -> TransferReport:
    """Copy a local model folder to the mirror, then write the mirror's manifest last."""
    if is_object_url(mirror):
        return _copy_objects("sync", mirror, local, check, settings, overrides)
    return _copy_tree("sync", Path(local), Path(mirror), check, settings, overrides)


def _copy_objects(
    job: str,
    url: str | os.PathLike[str],
    local: str | os.PathLike[str],
    check: bool,
    settings: Settings | None,
    overrides: dict[str, Any],
) -> TransferReport:
    """A hydrate from the bucket at ``url`` to ``local``, or a sync the other way."""
    job_settings = (settings if settings is not None else from_env()).replace(**overrides)
    where = ObjectURL.parse(
        str(url), variable=f"{job} {'source' if job == 'hydrate' else 'mirror'}"
    )
    if job == "hydrate":
        report = run(object_hydrate_plan(where, Path(local), job_settings), job_settings)
    else:
        report = sync_to_objects(Path(local), where, job_settings)
    if check and not report.ok:
        raise TransferFailed(report)
    return report


def _copy_tree(
    job: str,
    src: Path,
    dst: Path,
    check: bool,
    settings: Settings | None,
    overrides: dict[str, Any],
) -> TransferReport:
    job_settings = (settings if settings is not None else from_env()).replace(**overrides)
    # A hydrate lists the mirror by its manifest; a sync writes it.
    plan = tree_plan(job, src, dst, job_settings, use_manifest=job == "hydrate")
    report = run(plan, job_settings)
    if check and not report.ok:
        raise TransferFailed(report)
    return report


def tree_plan(job: str, src: Path, dst: Path, settings: Settings, *, use_manifest: bool) -> Plan:
    """The plan copying the whole tree at ``src`` to ``dst``. A hydrate
    (``use_manifest``) lists the mirror by its manifest, once no sync is writing it; a
    sync marks the mirror while it writes and ends by writing the manifest (see
    :mod:`loaderplug.jobs.sync_mark`)."""
    _check_apart(job, src, dst)
    wait_s, stale_s = settings.sync_wait_s, settings.sync_stale_s
    retry = RetryPolicy.of(settings)

    def list_files() -> Listing:
        if use_manifest:
            wait_for_sync(src, wait_s, stale_s, retry=retry)
        return _list_tree(src, dst, use_manifest)

    def finish(listing: Listing, report: TransferReport) -> None:
        _write_manifest(dst, listing, report)

    return Plan(
        job=job,
        source=str(src),
        destination=dst,
        list_files=list_files,
        locks=(folder_lock(dst),),
        leftovers=lambda: temp_files(dst),
        finish=None if use_manifest else finish,
        around=None if use_manifest else (lambda: SyncMark(dst, wait_s, stale_s, retry)),
    )


def select(
    job: str,
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    files: dict[str, str],
    symlinks: dict[str, str],
    settings: Settings,
    *,
    expect: Expect | None = None,
    lock_in: str = "",
) -> TransferReport:
    """Copy chosen files of ``src`` to ``dst`` under ``dst``'s lock: ``files`` maps each
    destination path to its source path (both relative), ``symlinks`` a destination path
    to its relative target. ``expect`` says what each copied file must hash to; one that
    does not is never published.
    ``lock_in`` puts the lock in a subfolder of ``dst`` (one its owner ignores).

    This is how a layout that is not a plain mirror of a folder (a Hub cache, say) is
    copied with the engine's guarantees.
    """
    src_path, dst_path = Path(src), Path(dst)
    _check_apart(job, src_path, dst_path)
    plan = Plan(
        job=job,
        source=str(src_path),
        destination=dst_path,
        list_files=lambda: _list_selection(src_path, dst_path, files, symlinks),
        locks=(folder_lock(dst_path / lock_in),),
        # Only the chosen files' leftovers: dst may hold much else (a user's local_dir).
        leftovers=lambda: [t for rel in files for t in temps_of(dst_path / rel)],
        expect=expect,
    )
    return run(plan, settings)


def _list_selection(
    src: Path, dst: Path, files: dict[str, str], symlinks: dict[str, str]
) -> Listing:
    """The selection as a listing. It may come from a mirror's own listing: nothing may
    land, or be read, outside the two roots."""
    root = os.path.realpath(src) + os.sep
    chosen = Listing()
    for rel, target in sorted(symlinks.items()):
        problem = path_problem(rel) or symlink_problem(rel, target)
        if problem:
            chosen.refused[rel] = problem
        else:
            chosen.symlinks[rel] = target
    for rel, origin in sorted(files.items()):
        problem = path_problem(rel) or path_problem(origin)
        if not problem and not os.path.realpath(src / origin).startswith(root):
            problem = f"{origin} resolves outside the mirror root and is refused"
        if problem:
            chosen.refused[rel] = problem
            continue
        try:
            st = os.stat(src / origin)
        except OSError as exc:
            chosen.refused[rel] = f"cannot read {origin} on the mirror: {exc.strerror or exc}"
            continue
        chosen.files.append(FileEntry.of(rel, src / origin, st, dst / rel))
    parents = {posixpath.dirname(e.rel) for e in chosen.files}
    parents |= {posixpath.dirname(rel) for rel in chosen.symlinks}
    chosen.dirs = sorted(d for d in parents if d)
    return chosen


def _check_apart(job: str, src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise MirrorError(f"{job} source {src} is not a folder; check the path")
    src_real, dst_real = src.resolve(), dst.resolve()
    if src_real == dst_real or src_real in dst_real.parents or dst_real in src_real.parents:
        raise MirrorError(f"{job} source {src} and destination {dst} overlap; pick folders apart")


def _list_tree(src: Path, dst: Path, use_manifest: bool) -> Listing:
    """What a tree copy copies: the source's manifest when it has one (and may use it),
    else a walk of the source; each file goes to the same path under ``dst``."""
    manifest = manifest_mod.read(src) if use_manifest else None
    if manifest is None:
        tree = walk(src)
        files = [
            FileEntry.of(rel, src / rel, st, dst / rel) for rel, st in sorted(tree.files.items())
        ]
        return Listing(files, tree.symlinks, tree.dirs, dict(tree.refused))
    listing = Listing(symlinks=dict(manifest.symlinks), refused=dict(manifest.refused))
    root = os.path.realpath(src)
    for rel, (size, mtime_ns) in sorted(manifest.files.items()):
        path = src / rel
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            listing.refused[rel] = "listed in the mirror's manifest but missing on the mirror"
            continue
        if not os.path.realpath(path).startswith(root + os.sep):
            # A folder on the way is a symlink that leads out of the mirror.
            listing.refused[rel] = "resolves outside the mirror root and is refused"
        elif not stat.S_ISREG(st.st_mode):
            listing.refused[rel] = "listed in the manifest but not a regular file on the mirror"
        elif (st.st_size, st.st_mtime_ns) != (size, mtime_ns):
            listing.refused[rel] = (
                f"changed since the mirror's manifest was written (size {st.st_size}, "
                f"mtime_ns {st.st_mtime_ns}; the manifest says {size}, {mtime_ns}); "
                f"a sync may be under way: retry when it finishes"
            )
        else:
            listing.files.append(FileEntry.of(rel, path, st, dst / rel))
    return listing


def _write_manifest(dst: Path, listing: Listing, report: TransferReport) -> None:
    # Files as the mirror shows them now (its own size and mtime, so a filesystem with
    # coarse timestamps still matches), and every failure by name: a failed file is
    # reported by the next hydrate instead of silently missing.
    files, links, incomplete = {}, {}, {}
    for result in report.results:
        rel = result.path
        if result.status == "failed":
            incomplete[rel] = result.reason
        elif rel in listing.symlinks:
            links[rel] = listing.symlinks[rel]
        else:
            st = os.lstat(dst / rel)
            files[rel] = (st.st_size, st.st_mtime_ns)
    manifest_mod.write(dst, files, links, incomplete)
