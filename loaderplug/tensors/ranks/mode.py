"""How a shared load is split and shared: which rank reads each file, each rank's part
of the host's memory budget, and how tensors reach the other ranks."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from loaderplug.jobs.current_copy import is_current_copy
from loaderplug.settings import BY_FIELD, Settings
from loaderplug.storage.mounts import filesystem_type, is_network_type
from loaderplug.types import Identity

SharingMode = Literal["pagecache", "broadcast", "stream"]


def owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The rank that reads each file: largest files first, each to the rank with the
    fewest bytes so far (ties: the lower rank). The same on every rank."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += sizes[index]
    return owner


def rank_part(host_bytes_in_flight: int, ranks: int) -> int:
    """One rank's part of the host's bytes in flight (never below the setting's floor)."""
    return max(host_bytes_in_flight // ranks, BY_FIELD["bytes_in_flight"].minimum or 1)


def sharing_mode(
    paths: Sequence[Path], device: str, local_dir: Path | None, settings: Settings
) -> SharingMode:
    """How tensors reach the other ranks: as the setting says, or (auto) as measured
    best (benchmarks/scale_bench.py, 3.8 GiB, the last two full runs of 2026-12-04):
    for CPU tensors, the page cache where the bytes are on a local filesystem, the
    stream for a one pass from a network mirror. Read in place: 0.42-0.47x safe_open's
    time per rank at 2 ranks, 0.60-0.67x at 4 (the broadcast 0.90-1.12x and
    2.09-2.39x). A one pass from the mirror: the stream 0.98x a plain hydrate at 2 and
    at 4 ranks in both runs, for the least CPU (0.7-1.0 s per GiB of the model at 2
    ranks; the broadcast 1.7-2.0, the page cache 2.3-2.7); the broadcast 1.01-1.16x at
    2 ranks and 1.74-1.84x at 4 (each rank receives (N-1)/N of the model through a
    socket); the page cache 1.05-1.29x (it waits for whole files, and holds the whole
    copy in memory). A broadcast otherwise: for CUDA tensors, and for network files
    read in place, whose pages another process's mapping would read again from the
    network. Only loaderplug's own local copies on a local filesystem are mapped (see
    :func:`_not_to_map`): a forced mode that maps files (pagecache, stream) is not used
    on any other file; a warning says so and the ranks broadcast. Ranks may see a
    local copy change between their looks: :func:`loaderplug.tensors.ranks.shared.shared_tensors`
    makes them agree."""
    unmappable = _not_to_map(paths, local_dir, settings)
    if settings.rank_sharing != "auto":
        return _forced(settings.rank_sharing, unmappable)
    if device != "cpu" or unmappable:
        return "broadcast"
    if local_dir is not None and copies_from_network(paths, local_dir):
        return "stream"
    return "pagecache"


def _not_to_map(
    paths: Sequence[Path], local_dir: Path | None, settings: Settings
) -> tuple[Path, str] | None:
    """A folder whose files the ranks would map and must not, with why; None if every
    file they would map is one of loaderplug's own local copies on a local filesystem.

    A mapped page past a file's new end kills the process (SIGBUS), so only files that
    nothing truncates are mapped: the copies loaderplug publishes (replaced by rename,
    never rewritten in place), not a user's folder, and nothing on a network filesystem,
    where another machine may truncate what this host maps."""
    folders = {local_dir} if local_dir is not None else {p.parent for p in paths}
    on_network = _network_folders(folders)
    if on_network:
        folder, fs = next(iter(on_network.items()))
        return folder, f"on a network filesystem ({fs}), where another machine may truncate it"
    own = _real(settings.local_models_dir)
    for folder in sorted(folders):
        if local_dir is None and not _real(folder).is_relative_to(own):
            return folder, "not one of loaderplug's own copies, so another process may truncate it"
    return None


def _real(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return path


def _network_folders(folders: set[Path]) -> dict[Path, str]:
    """Those of ``folders`` on a network filesystem, with its type."""
    types = {folder: filesystem_type(folder) for folder in folders}
    return {folder: fs for folder, fs in sorted(types.items()) if is_network_type(fs)}


def _forced(mode: SharingMode, unmappable: tuple[Path, str] | None) -> SharingMode:
    """The mode LOADERPLUG_RANK_SHARING forces, but never a mapping of a file that may
    be truncated under it (see :func:`_not_to_map`): those ranks broadcast instead."""
    if mode == "broadcast" or unmappable is None:
        return mode
    folder, why = unmappable
    warnings.warn(
        f"LOADERPLUG_RANK_SHARING={mode} is not used: the ranks would map files in "
        f"{folder}, {why} under the mapping (SIGBUS); they broadcast the tensors instead",
        stacklevel=3,
    )
    return "broadcast"


def copies_from_network(paths: Sequence[Path], local_dir: Path) -> bool:
    """Whether a one pass into ``local_dir`` reads some file from a network filesystem:
    one whose copy there is not current (a current copy is read instead)."""
    folders = {path.parent for path in paths}
    on_network = {folder for folder in folders if is_network_type(filesystem_type(folder))}
    for path in paths:
        if path.parent not in on_network:
            continue
        try:
            identity = Identity.of(os.stat(path))
        except OSError:
            return True  # the load itself says what is wrong with it
        if not is_current_copy(local_dir / path.name, identity):
            return True
    return False
