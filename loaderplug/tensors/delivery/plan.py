"""Loads as plans: which files a load reads, where a one pass publishes them, and how
their tensors are handed over (:mod:`loaderplug.tensors.delivery.choice`); the runner
(:mod:`loaderplug.jobs.runner`) runs them.

A load is a job like a hydrate: with ``local_dir`` (a one pass) it runs under the local
folder's lock, or, for ranks that split the files between them, under a lock per file it
publishes, so the ranks copy side by side.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from loaderplug.engine.buffers import Opener
from loaderplug.errors import FileError
from loaderplug.jobs.file_sink import temps_of
from loaderplug.jobs.locks import file_lock, folder_lock
from loaderplug.jobs.plan import FileEntry, Listing, Plan
from loaderplug.settings import Settings
from loaderplug.storage.mounts import filesystem_type, is_network_type
from loaderplug.storage.object_source import ObjectFiles, object_policy
from loaderplug.storage.object_urls import ObjectURL, is_object_url
from loaderplug.tensors.delivery.choice import TensorDelivery
from loaderplug.tensors.delivery.map_rule import MapRule
from loaderplug.tensors.device.path import DevicePath


def load_plan(
    paths: Sequence[str | os.PathLike[str]],
    device: DevicePath,
    settings: Settings,
    local_dir: str | os.PathLike[str] | None = None,
    *,
    lock_each_file: bool = False,
    through_page_cache: bool = False,
    shared_by_ranks: bool = False,
    open_source: Opener | None = None,
) -> Plan:
    """The plan of a load: each file read in place, or with ``local_dir`` hydrated there
    (same name) in the same pass, under that folder's lock (with ``lock_each_file``,
    under a lock per file instead). With ``through_page_cache`` (ranks of a host that
    share its page cache) each file is read, or in a one pass written to its copy,
    through the page cache, and its tensors are views of it; not where the copies go to
    a network filesystem, whose pages other processes cannot share. Which files in
    memory are mapped is the load's :class:`~loaderplug.tensors.delivery.map_rule.MapRule`
    (``shared_by_ranks``: the ranks' own, which maps only own local copies).
    ``open_source``: what the engine reads the files through (a split across hosts)."""
    local = Path(local_dir) if local_dir is not None else None
    if local is not None and is_network_type(filesystem_type(local)):
        through_page_cache = False
    delivery = TensorDelivery(
        device,
        settings,
        through_page_cache=through_page_cache,
        map_rule=MapRule.of(settings, local, shared_by_ranks=shared_by_ranks),
    )
    if paths and all(is_object_url(p) for p in paths):
        return _objects_plan([str(p) for p in paths], local, delivery, settings, lock_each_file)
    files = [Path(p) for p in paths]

    def list_files() -> Listing:
        listing = Listing()
        for path in files:
            try:
                st = os.stat(path)
            except OSError as exc:
                raise FileError(
                    f"{path}: cannot read it: {exc.strerror or exc}",
                    path=str(path),
                    errno=exc.errno,
                ) from exc
            copy_to = local / path.name if local is not None else None
            listing.files.append(FileEntry.of(path.name, path, st, copy_to))
        return listing

    return Plan(
        job="load",
        source=",".join(map(str, paths)),
        destination=local,
        list_files=list_files,
        locks=_locks(local, [f.name for f in files], lock_each_file),
        leftovers=lambda: [t for f in files for t in temps_of(local / f.name)] if local else [],
        delivery=delivery,
        open_source=open_source,
    )


def _objects_plan(
    urls: list[str],
    local: Path | None,
    delivery: TensorDelivery,
    settings: Settings,
    lock_each_file: bool,
) -> Plan:
    """The plan of a load of objects in a store: each asked for once (a HEAD), read by
    ranged GETs at that version; with ``local``, published there as by any one pass."""
    objects = ObjectFiles(settings.object_timeout_s)
    where = [ObjectURL.parse(u, variable="path") for u in urls]
    names = [u.name for u in where]

    def list_files() -> Listing:
        listing = Listing()
        for url in where:
            identity = objects.head(url).identity()
            copy_to = local / url.name if local is not None else None
            listing.files.append(FileEntry(url.name, str(url), identity, copy_to))
        return listing

    return Plan(
        job="load",
        source=",".join(urls),
        destination=local,
        list_files=list_files,
        locks=_locks(local, names, lock_each_file),
        leftovers=lambda: [t for n in names for t in temps_of(local / n)] if local else [],
        delivery=delivery,
        open_source=objects,
        source_policy=object_policy(where[0]),
    )


def _locks(local: Path | None, names: list[str], each_file: bool) -> tuple[Path, ...]:
    if local is None:
        return ()
    if not each_file:
        return (folder_lock(local),)
    # Sorted: two jobs that share some files take their locks in the same order.
    return tuple(sorted(file_lock(local / name) for name in names))
