"""Where a model's weights come from, and streaming them in one pass: the core of the
``volcache`` load format, free of any framework so every loader can share it.

A model is named as a serving framework names it: a folder, or a Hub repo id.

* A folder on a network or userspace filesystem (the volume mirror), or under
  ``LOADERPLUG_VOLUME``, is a mirror: its weights are hydrated into a local copy under
  ``LOADERPLUG_LOCAL_DIR`` and streamed as they land, each byte read from the volume
  once. A later start on the same host finds the copy current and reads it instead.
* A folder on local disk is read where it is.
* A repo id is looked up in the local Hugging Face cache, then on the mirror (its Hub
  layout ``<volume>/hub``, then ``<volume>/models/<repo id>``).

Weights are chosen the way vLLM's default loader chooses them: the folder's
``*.safetensors`` (never ``original/``), restricted to the files the index's
``weight_map`` names; a file the index names but the folder lacks is an error.

Processes loading the same model at once (tensor-parallel ranks) share one copy: they
take the local copy's lock in turn, so one reads the mirror and the others then find
every file current and read local disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loaderplug.errors import LoaderplugError, TransferFailed
from loaderplug.fs import is_network_type
from loaderplug.lock import locked
from loaderplug.plugins import first_result, plugin_manager
from loaderplug.reader import iter_tensors
from loaderplug.settings import Settings
from loaderplug.volume import MirrorRequest, select

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class WeightsError(LoaderplugError):
    """The model's weights cannot be found or chosen."""


@dataclass(frozen=True)
class WeightPlan:
    """The weight files to read, and where their local copy goes (None: read in place)."""

    model: str
    folder: Path
    files: list[Path]
    local_copy: Path | None


def weight_files(folder: Path) -> list[Path]:
    """The folder's ``*.safetensors``, limited to those its index names, as vLLM does."""
    found = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            named = {str(v) for v in weight_map.values()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightsError(f"{index}: not a valid safetensors index ({exc})") from exc
        missing = sorted(named - {p.name for p in found})
        if missing:
            raise WeightsError(
                f"{folder}: weight files named in {INDEX_NAME} are missing: {', '.join(missing)}"
            )
        found = [p for p in found if p.name in named]
    if not found:
        raise WeightsError(f"{folder}: no *.safetensors weights found")
    return found


def plan(model: str, revision: str | None, settings: Settings) -> WeightPlan:
    """Decide where ``model``'s weights are read from, and whether they are hydrated."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        folder = folder.resolve()
        mirrored = is_mirror(folder, settings)
        copy = local_copy(folder, settings) if mirrored else None
        return WeightPlan(model, folder, weight_files(folder), copy)
    if not _REPO_ID.match(model):
        raise WeightsError(f"{model}: neither a folder nor a Hub repo id")
    cached = _in_hf_cache(model, revision)
    if cached is not None:
        try:
            return WeightPlan(model, cached, weight_files(cached), None)
        except WeightsError:  # a snapshot holding only the config: look on the mirror
            pass
    on_mirror = _on_mirror(model, revision, settings)
    if on_mirror is not None:
        copy = local_copy(on_mirror, settings, name=model.replace("/", "--"))
        return WeightPlan(model, on_mirror, weight_files(on_mirror), copy)
    raise WeightsError(
        f"{model}: not in the local Hugging Face cache and not on the mirror "
        f"({settings.volume or 'LOADERPLUG_VOLUME is unset'})"
    )


def stream(plan: WeightPlan, settings: Settings) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every weight of ``plan`` as ``(name, tensor)``, owned, on the CPU."""
    if settings.reader == "fastsafetensors":
        yield from _through_fastsafetensors(plan, settings)
        return
    if plan.local_copy is None:
        yield from iter_tensors(plan.files, settings=settings)
        return
    # The lock is held only while stale files are read from the mirror (and written
    # locally in the same pass): ranks that find the copy current read it side by side.
    with locked(plan.local_copy, settings.lock_timeout_s):
        stale = [f for f in plan.files if not _is_current_copy(f, plan.local_copy / f.name)]
        if stale:
            yield from iter_tensors(stale, local_dir=plan.local_copy, settings=settings)
    current = [plan.local_copy / f.name for f in plan.files if f not in stale]
    if current:
        yield from iter_tensors(current, settings=settings)


def hydrate_copy(folder: Path, names: list[str], copy: Path, settings: Settings) -> None:
    """Hydrate ``names`` of ``folder`` into ``copy`` (a no-op for current files)."""
    report = select("hydrate", folder, copy, {n: n for n in names}, {}, settings)
    if not report.ok:
        raise TransferFailed(report)


def _through_fastsafetensors(
    plan: WeightPlan, settings: Settings
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hydrate first (two passes: fastsafetensors reads whole local files), then read
    with fastsafetensors, for hosts where its GPUDirect Storage path pays off."""
    from . import fastsafetensors

    files = plan.files
    if plan.local_copy is not None:
        hydrate_copy(plan.folder, [f.name for f in files], plan.local_copy, settings)
        files = [plan.local_copy / f.name for f in files]
    yield from fastsafetensors.iter_tensors(files)


def is_mirror(folder: Path, settings: Settings) -> bool:
    if settings.volume and folder.is_relative_to(Path(settings.volume).resolve()):
        return True
    pm = plugin_manager(settings.disable_plugins)
    policy = first_result(pm, "loaderplug_io_policy", path=str(folder), mode="auto")
    return is_network_type(policy.fs_type)


def local_copy(folder: Path, settings: Settings, name: str = "") -> Path:
    # The model's name keeps the copy recognisable; a hash of the source's full path
    # keeps two models that share a name apart.
    digest = hashlib.sha256(str(folder).encode()).hexdigest()[:12]
    return settings.local_models_dir / f"{name or folder.name}-{digest}"


def _is_current_copy(source: Path, copy: Path) -> bool:
    """A copy the one pass published: same size, stamped with the source's mtime."""
    try:
        src, dst = source.stat(), copy.stat()
    except OSError:
        return False
    return (src.st_size, src.st_mtime_ns) == (dst.st_size, dst.st_mtime_ns)


def _in_hf_cache(repo_id: str, revision: str | None) -> Path | None:
    try:
        from .huggingface_hub import original_snapshot_download
    except ImportError:
        return None
    try:
        path = original_snapshot_download(
            repo_id,
            revision=revision,
            local_files_only=True,
            allow_patterns=["*.safetensors", "*.json"],
        )
    except Exception:  # not cached (the client's errors vary by version)
        return None
    return Path(path)


def _on_mirror(repo_id: str, revision: str | None, settings: Settings) -> Path | None:
    """The repo's snapshot on the mirror's Hub layout, else its ``models/`` folder."""
    from . import hub_mirror

    pm = plugin_manager(settings.disable_plugins)
    find = pm.hook.loaderplug_find_mirror
    # The volume given in these settings (a loader's own option) comes first; plugins and
    # LOADERPLUG_VOLUME answer otherwise.
    volume = Path(settings.volume) if settings.volume else None
    hub_roots = [volume / "hub"] if volume else []
    hub_roots.append(find(request=MirrorRequest("hub", repo_id, revision)))
    for root in filter(None, hub_roots):
        repo = Path(root) / ("models--" + repo_id.replace("/", "--"))
        commit = hub_mirror.resolve_commit(repo, revision or "main")
        if commit is not None and (repo / "snapshots" / commit).is_dir():
            return repo / "snapshots" / commit
    folders = [volume / "models" / repo_id] if volume else []
    folders.append(find(request=MirrorRequest("folder", repo_id, revision)))
    return next((Path(f) for f in folders if f is not None and Path(f).is_dir()), None)


def describe(plan: WeightPlan) -> str:
    size = sum(os.path.getsize(f) for f in plan.files)
    where = f"hydrating into {plan.local_copy}" if plan.local_copy else "reading in place"
    return (
        f"{len(plan.files)} safetensors file(s), {size / 2**20:.0f} MiB from {plan.folder}, {where}"
    )
