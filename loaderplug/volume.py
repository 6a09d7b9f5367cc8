"""Hydrate (mirror → local disk) and sync (local disk → mirror), end to end.

Both are one job for the range engine: list the source (its manifest when a mirror has
one, else a walk), skip what the destination already holds, copy the rest through
:class:`FileSink` s, recreate relative symlinks, and report every file. Both run under
the destination's cross-process lock; sync writes the mirror's manifest last.
"""

from __future__ import annotations

import functools
import glob
import mmap
import os
import posixpath
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from loaderplug import manifest as manifest_mod
from loaderplug.engine import Engine, FileJob
from loaderplug.errors import MirrorError, TransferFailed
from loaderplug.fs import IOPolicy, is_network_type
from loaderplug.lock import locked
from loaderplug.plugins import first_result, plugin_manager
from loaderplug.report import FileResult, TransferReport
from loaderplug.settings import Settings, from_env
from loaderplug.sinks import TEMP_SUFFIX, FileSink, temp_name_for
from loaderplug.source import Identity
from loaderplug.tree import Tree, path_problem, symlink_problem, temp_files, walk


@dataclass(frozen=True)
class MirrorRequest:
    """What a caller wants from the mirror: ``kind`` is ``hub`` (a Hub repo, kept in the
    Hub's cache layout under ``<volume>/hub``) or ``folder`` (``<volume>/models/<name>``)."""

    kind: str
    name: str
    revision: str | None = None

    @property
    def subpath(self) -> str:
        return "hub" if self.kind == "hub" else f"models/{self.name}"


@dataclass
class _Listing:
    """The source side of a job: files with their pinned identity, symlinks, refusals."""

    files: dict[str, Identity]
    symlinks: dict[str, str]
    dirs: list[str]
    refused: dict[str, str]
    # Where a file comes from, where that differs from where it goes (``select``).
    sources: dict[str, str] = field(default_factory=dict)


def _list_source(src: Path, use_manifest: bool) -> _Listing:
    manifest = manifest_mod.read(src) if use_manifest else None
    if manifest is None:
        tree: Tree = walk(src)
        files = {rel: Identity.of(st) for rel, st in tree.files.items()}
        return _Listing(files, tree.symlinks, tree.dirs, dict(tree.refused))
    listing = _Listing({}, dict(manifest.symlinks), [], dict(manifest.refused))
    root = os.path.realpath(src)
    for rel, (size, mtime_ns) in manifest.files.items():
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
            listing.files[rel] = Identity.of(st)
    return listing


def _is_current(dst: Path, identity: Identity) -> bool:
    try:
        st = os.lstat(dst)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_size == identity.size
        and st.st_mtime_ns == identity.mtime_ns
    )


def _make_dirs(dst: Path, dirs: list[str]) -> list[FileResult]:
    """Create the source's folders (empty ones included); a clash is that path's failure."""
    failures = []
    for rel in dirs:
        try:
            (dst / rel).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reason = f"cannot create the folder: {exc.strerror or exc}"
            failures.append(FileResult(rel, "failed", reason=reason, errno=exc.errno))
    return failures


def _place_symlink(dst_root: Path, rel: str, target: str, failed: set[str]) -> FileResult:
    """Recreate one relative symlink, unless what it points at failed to copy."""
    pointee = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    if pointee in failed:
        reason = f"not linked: its target {pointee} failed to copy"
        return FileResult(rel, "failed", reason=reason)
    dst = dst_root / rel
    try:
        if os.path.islink(dst) and os.readlink(dst) == target:
            return FileResult(rel, "skipped")
        dst.parent.mkdir(parents=True, exist_ok=True)
        temp = temp_name_for(dst)
        os.symlink(target, temp)
        try:
            os.replace(temp, dst)
        except BaseException:
            os.unlink(temp)
            raise
    except OSError as exc:
        return FileResult(rel, "failed", reason=f"cannot create symlink: {exc}", errno=exc.errno)
    return FileResult(rel, "linked")


class _PolicyCache:
    """One IO-policy decision per source folder, not per file."""

    def __init__(self, pm: pluggy.PluginManager, mode: str) -> None:
        self.pm, self.mode = pm, mode
        self._by_dir: dict[str, IOPolicy] = {}

    def __call__(self, path: Path) -> IOPolicy:
        key = str(path.parent)
        if key not in self._by_dir:
            # The destination folder may not exist yet: the policy of its filesystem is
            # decided from the nearest existing parent.
            self._by_dir[key] = first_result(
                self.pm, "loaderplug_io_policy", path=str(path), mode=self.mode
            )
        return self._by_dir[key]


def _progress(settings: Settings, total: int, desc: str) -> tuple[Callable[[int], None], Any]:
    if not (settings.progress and sys.stderr.isatty()) or total == 0:
        return (lambda n: None), None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)

    def update(n: int) -> None:
        bar.update(n)

    return update, bar


def file_sink(
    dst: Path,
    identity: Identity,
    settings: Settings,
    target: IOPolicy,
    verify: Callable[[Path], None] | None = None,
) -> FileSink:
    """The sink that publishes ``dst``, writing the way its filesystem wants."""
    return FileSink(
        dst,
        identity.size,
        identity.mtime_ns,
        fsync=settings.fsync,
        # Direct writes in whole pages only: a buffered tail must never share a page
        # with another range's direct write.
        direct_alignment=max(target.alignment, mmap.PAGESIZE) if target.direct else 0,
        # On a network filesystem glibc would emulate fallocate with a write per block.
        preallocate=not is_network_type(target.fs_type),
        verify=verify,
    )


def _file_jobs(
    listing: _Listing,
    src: Path,
    dst: Path,
    settings: Settings,
    pm: pluggy.PluginManager,
    verify: Verify | None,
) -> tuple[list[FileJob], list[FileResult]]:
    """A job per file that the destination does not already hold; the rest are skipped."""
    policy_for = _PolicyCache(pm, settings.direct_io)
    jobs, skipped = [], []
    for rel, identity in sorted(listing.files.items()):
        if _is_current(dst / rel, identity):
            skipped.append(FileResult(rel, "skipped", identity.size))
            continue
        check = functools.partial(verify, rel) if verify is not None else None
        sink = file_sink(dst / rel, identity, settings, policy_for(dst / rel), check)
        origin = src / listing.sources.get(rel, rel)
        jobs.append(FileJob(rel, str(origin), identity, [sink], policy_for(origin)))
    return jobs, skipped


# Called with a file's destination path (relative) and its finished temp file before
# that is published; raising refuses the file (see FileSink).
Verify = Callable[[str, Path], None]


def transfer(
    job: str,
    src: Path,
    dst: Path,
    settings: Settings,
    *,
    use_manifest: bool,
    write_manifest: bool,
) -> TransferReport:
    """Copy the tree at ``src`` to ``dst`` under ``dst``'s lock. The shared core of
    :func:`hydrate` and :func:`sync`."""
    src, dst = _check_apart(job, Path(src), Path(dst))
    return _run(
        job,
        src,
        dst,
        settings,
        lambda: _list_source(src, use_manifest),
        write_manifest=write_manifest,
    )


def select(
    job: str,
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    files: dict[str, str],
    symlinks: dict[str, str],
    settings: Settings,
    *,
    verify: Verify | None = None,
    lock_in: str = "",
) -> TransferReport:
    """Copy chosen files of ``src`` to ``dst`` under ``dst``'s lock: ``files`` maps each
    destination path to its source path (both relative), ``symlinks`` a destination path
    to its relative target. ``verify`` checks each copied file before it is published.
    ``lock_in`` puts the lock in a subfolder of ``dst`` (one its owner ignores).

    This is how a layout that is not a plain mirror of a folder (a Hub cache, say) is
    copied with the engine's guarantees.
    """
    src_path, dst_path = _check_apart(job, Path(src), Path(dst))

    root = os.path.realpath(src_path) + os.sep

    def listing() -> _Listing:
        chosen = _Listing({}, {}, [], {}, {})
        # The selection may come from a mirror's own listing: nothing may land, or be
        # read, outside the two roots.
        for rel, target in sorted(symlinks.items()):
            problem = path_problem(rel) or symlink_problem(rel, target)
            if problem:
                chosen.refused[rel] = problem
            else:
                chosen.symlinks[rel] = target
        for rel, origin in sorted(files.items()):
            problem = path_problem(rel) or path_problem(origin)
            if not problem and not os.path.realpath(src_path / origin).startswith(root):
                problem = f"{origin} resolves outside the mirror root and is refused"
            if problem:
                chosen.refused[rel] = problem
                continue
            try:
                st = os.stat(src_path / origin)
            except OSError as exc:
                chosen.refused[rel] = f"cannot read {origin} on the mirror: {exc.strerror or exc}"
                continue
            chosen.files[rel] = Identity.of(st)
            if origin != rel:
                chosen.sources[rel] = origin
        parents = {posixpath.dirname(rel) for rel in [*chosen.files, *chosen.symlinks]}
        chosen.dirs = sorted(d for d in parents if d)
        return chosen

    return _run(
        job,
        src_path,
        dst_path,
        settings,
        listing,
        write_manifest=False,
        verify=verify,
        lock_dir=dst_path / lock_in,
        # Only the chosen files' leftovers: dst may hold much else (a user's local_dir).
        leftovers=lambda: [t for rel in files for t in _temps_of(dst_path / rel)],
    )


def _temps_of(dst: Path) -> list[Path]:
    """Temp files a killed run left for ``dst`` (see sinks.temp_name_for)."""
    return list(dst.parent.glob(f".{glob.escape(dst.name)}.*{TEMP_SUFFIX}"))


def _check_apart(job: str, src: Path, dst: Path) -> tuple[Path, Path]:
    if not src.is_dir():
        raise MirrorError(f"{job} source {src} is not a folder; check the path")
    src_real, dst_real = src.resolve(), dst.resolve()
    if src_real == dst_real or src_real in dst_real.parents or dst_real in src_real.parents:
        raise MirrorError(f"{job} source {src} and destination {dst} overlap; pick folders apart")
    return src, dst


def _run(
    job: str,
    src: Path,
    dst: Path,
    settings: Settings,
    list_source: Callable[[], _Listing],
    *,
    write_manifest: bool,
    verify: Verify | None = None,
    lock_dir: Path | None = None,
    leftovers: Callable[[], list[Path]] | None = None,
) -> TransferReport:
    pm = plugin_manager(settings.disable_plugins)
    report = TransferReport(
        job, str(src), str(dst), settings.effective_workers, settings.effective_chunk_bytes
    )
    with locked(lock_dir or dst, settings.lock_timeout_s) as waited:
        report.waited_for_lock_s = waited
        # We hold the lock, so any temp file here belongs to a run that died.
        for leftover in leftovers() if leftovers is not None else temp_files(dst):
            leftover.unlink(missing_ok=True)
        listing = list_source()
        started = time.monotonic()
        dir_failures = _make_dirs(dst, listing.dirs)
        jobs, skipped = _file_jobs(listing, src, dst, settings, pm, verify)
        report.results.extend(skipped + dir_failures)
        on_bytes, bar = _progress(settings, sum(j.size for j in jobs), f"{job} {src.name}")
        engine = Engine(settings, pm, job=job, on_bytes=on_bytes)
        try:
            report.results.extend(engine.run(jobs))
        finally:
            if bar is not None:
                bar.close()
        failed = {r.path for r in report.results if r.status == "failed"} | set(listing.refused)
        others = [
            _place_symlink(dst, rel, t, failed) for rel, t in sorted(listing.symlinks.items())
        ]
        others += [
            FileResult(rel, "failed", reason=r) for rel, r in sorted(listing.refused.items())
        ]
        report.results.extend(others)
        # The engine told observers about the files it copied; these are the rest.
        for result in skipped + dir_failures + others:
            pm.hook.loaderplug_on_file_done(job=job, result=result)
        if write_manifest:
            _write_manifest(dst, listing, report)
        report.workers, report.chunk_bytes = engine.workers, engine.chunk
        if settings.adaptive_workers:  # the limit it ended at, and how far it moved
            report.workers = engine.limit.limit
            report.workers_range = (engine.limit.lowest, engine.limit.highest)
        report.bytes_copied = engine.bytes_copied
        report.retries = engine.retries
        report.seconds = time.monotonic() - started
    pm.hook.loaderplug_on_job_done(report=report)
    return report


def _write_manifest(dst: Path, listing: _Listing, report: TransferReport) -> None:
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


def hydrate(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    check: bool = True,
    settings: Settings | None = None,
    **overrides: Any,
) -> TransferReport:
    """Copy a model folder from a volume mirror to local disk, range-parallel.

    ``overrides`` are settings by field name (``hydrate_workers=16``,
    ``chunk_bytes="16M"``) and win over ``LOADERPLUG_*`` variables. With ``check`` (the
    default) a job with failed files raises :class:`TransferFailed`, whose ``report``
    says what happened to each file; every file that did land is published.
    """
    base = settings if settings is not None else from_env()
    report = transfer(
        "hydrate",
        Path(src),
        Path(dst),
        base.replace(**overrides),
        use_manifest=True,
        write_manifest=False,
    )
    if check and not report.ok:
        raise TransferFailed(report)
    return report


def sync(
    local: str | os.PathLike[str],
    mirror: str | os.PathLike[str],
    *,
    check: bool = True,
    settings: Settings | None = None,
    **overrides: Any,
) -> TransferReport:
    """Copy a local model folder to the mirror, then write the mirror's manifest last."""
    base = settings if settings is not None else from_env()
    report = transfer(
        "sync",
        Path(local),
        Path(mirror),
        base.replace(**overrides),
        use_manifest=False,
        write_manifest=True,
    )
    if check and not report.ok:
        raise TransferFailed(report)
    return report
