"""Where a model's weights come from, and streaming them in one pass: the core of the
``volcache`` load format, free of any framework so every loader can share it.

A model is named as a serving framework names it: a folder, or a Hub repo id.

* A folder on a network or userspace filesystem (the volume mirror), or under
  ``LOADERPLUG_MIRROR``, is a mirror: its weights are hydrated into a local copy under
  ``LOADERPLUG_LOCAL_COPIES`` and streamed as they land, each byte read from the volume
  once. A later start on the same host finds the copy current and reads it instead.
* A folder on local disk is read where it is.
* A repo id is pinned to one commit (the one vLLM read its config of: see
  :mod:`loaderplug.integrations.hub.commits`), then looked up at that commit in the
  local Hugging Face cache, then on the mirror (its Hub layout ``<volume>/hub``, then
  ``<volume>/models/<repo id>``), and failing both downloaded from the Hub as vLLM's
  own loader would, which fills the mirror for the next worker.

Weights are chosen the way vLLM's default loader chooses them: the folder's
``*.safetensors`` (never ``original/``), restricted to the files the index's
``weight_map`` names; a file the index names but the folder lacks is an error.

Processes loading the same model at once (tensor-parallel ranks) share one copy: the
one pass is a job like a hydrate (:mod:`loaderplug.jobs.runner`), so they take the local
copy's lock in turn: one reads the mirror, and the others then find every file current
and read local disk.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loaderplug.errors import WeightsError
from loaderplug.integrations.upstream import UpstreamChanged
from loaderplug.jobs.local_copies import hydrate_copy, is_mirror, local_copy
from loaderplug.plugins.manager import Plugins
from loaderplug.settings import Settings
from loaderplug.tensors.reader import iter_tensors
from loaderplug.types import MirrorRequest
from loaderplug.units import MiB

if TYPE_CHECKING:
    import torch

    from loaderplug.tensors.delivery.load import Load

INDEX_NAME = "model.safetensors.index.json"
# What a download of the weights fetches, as vLLM's default loader fetches safetensors.
WEIGHT_PATTERNS = ("*.safetensors", INDEX_NAME)
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelWeights:
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


def locate_weights(model: str, revision: str | None, settings: Settings) -> ModelWeights:
    """Decide where ``model``'s weights are read from, and whether they are hydrated."""
    folder = Path(model).expanduser()
    snapshot = _snapshot_without_weights(folder) if folder.is_dir() else None
    if snapshot is not None:
        # vLLM offline names a repo by the snapshot a path lookup gave it (its config and
        # tokenizer, not its weights): load that repo at that commit.
        model, revision = snapshot
    elif folder.is_dir():
        folder = folder.resolve()
        mirrored = is_mirror(folder, settings)
        copy = local_copy(folder, settings) if mirrored else None
        return ModelWeights(model, folder, weight_files(folder), copy)
    if not _REPO_ID.match(model):
        raise WeightsError(f"{model}: neither a folder nor a Hub repo id")
    hub = _hub_integration()
    # The commit the rest of this process's load uses (vLLM read the config of it).
    commit = hub.pinned_commit(model, revision, settings) if hub is not None else None
    cached = _in_hf_cache(model, commit or revision)
    if cached is not None:
        try:
            return ModelWeights(model, cached, weight_files(cached), None)
        except WeightsError:  # a snapshot holding only the config: look on the mirror
            pass
    on_mirror = _on_mirror(model, commit or revision, settings)
    if on_mirror is not None:
        try:
            files = weight_files(on_mirror)
        except WeightsError:  # a snapshot of the config alone: the weights are downloaded
            files = []
        if files:
            copy = local_copy(on_mirror, settings, name=model.replace("/", "--"))
            return ModelWeights(model, on_mirror, files, copy)
    if hub is not None and not hub.offline():
        # As vLLM's own loader: download the weights (which fills the mirror), read them.
        try:
            folder = hub.download_weights(model, revision, commit, list(WEIGHT_PATTERNS))
        except Exception as exc:
            raise WeightsError(
                f"{model}: not in the local Hugging Face cache, not on the mirror "
                f"({settings.mirror or 'LOADERPLUG_MIRROR is unset'}), and the Hub download "
                f"failed: {type(exc).__name__}: {exc}"
            ) from exc
        return ModelWeights(model, folder, weight_files(folder), None)
    raise WeightsError(
        f"{model}: not in the local Hugging Face cache and not on the mirror "
        f"({settings.mirror or 'LOADERPLUG_MIRROR is unset'}), and the Hub "
        + ("is offline (HF_HUB_OFFLINE)" if hub is not None else "client is not installed")
    )


def stream(
    weights: ModelWeights, settings: Settings, group: Any = None, device: str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every weight as ``(name, tensor)``, whole, on ``device``: read in place, or
    in one pass that hydrates the local copy (current files there are read locally).
    The ranks of a process ``group`` split the reading (see
    :mod:`loaderplug.tensors.ranks.shared`)."""
    if settings.weights_reader == "fastsafetensors":
        for name, tensor in _through_fastsafetensors(weights, settings):
            yield name, tensor if device == "cpu" else tensor.to(device)
        return
    load = iter_tensors(
        weights.files, device, local_dir=weights.local_copy, group=group, settings=settings
    )
    yield from load
    log.info("loaderplug: %s", loaded(load))


def loaded(load: Load) -> str:
    """What a finished load did, in a line: bytes read and mapped, the time to the first
    tensor and, for ranks sharing it, how (a rank's report is of the files it read)."""
    report = load.report
    if report is None:
        return "loaded"
    files = len(report.results)
    parts = [f"{files} file(s)" if load.sharing is None else f"{files} of {len(load.owners)} files"]
    if report.bytes_copied:
        parts.append(
            f"{report.bytes_copied / MiB:.1f} MiB read in {report.seconds:.2f} s "
            f"({report.mib_per_s:.1f} MiB/s)"
        )
    if report.bytes_mapped:
        parts.append(f"{report.bytes_mapped / MiB:.1f} MiB mapped, read as touched")
    if load.first_tensor_s is not None:
        parts.append(f"first tensor at {load.first_tensor_s:.2f} s")
    if load.sharing is not None:
        parts.append(f"the ranks on this host shared the rest by {load.sharing}")
    if load.hosts is not None:
        parts.append(load.hosts.describe())
    return "; ".join(parts)


def _through_fastsafetensors(
    weights: ModelWeights, settings: Settings
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hydrate first (two passes: fastsafetensors reads whole local files), then read
    with fastsafetensors, for hosts where its GPUDirect Storage path pays off."""
    from loaderplug.integrations import fastsafetensors

    files = weights.files
    if weights.local_copy is not None:
        hydrate_copy(weights.folder, [f.name for f in files], weights.local_copy, settings)
        files = [weights.local_copy / f.name for f in files]
    yield from fastsafetensors.iter_tensors(files, settings)


def _snapshot_without_weights(folder: Path) -> tuple[str, str] | None:
    """The repo id and commit of a Hugging Face cache snapshot (``.../models--org--name/
    snapshots/<commit>``) that holds no weights, else None."""
    folder = folder.absolute()
    repo_folder = folder.parent.parent
    if folder.parent.name != "snapshots" or not repo_folder.name.startswith("models--"):
        return None
    if not re.fullmatch(r"[0-9a-f]{40}", folder.name):
        return None
    try:
        weight_files(folder)
    except WeightsError:
        return repo_folder.name[len("models--") :].replace("--", "/"), folder.name
    return None


def _hub_integration() -> Any:
    """loaderplug's Hub integration, or None where huggingface_hub is not installed (or
    moved a name it uses: said once)."""
    try:
        from loaderplug.integrations import huggingface_hub
    except ImportError:
        return None
    except UpstreamChanged as exc:  # the installed huggingface_hub moved a name we use
        log.warning("loaderplug: not using the Hugging Face Hub or its cache: %s", exc)
        return None
    return huggingface_hub


def _in_hf_cache(repo_id: str, revision: str | None) -> Path | None:
    hub = _hub_integration()
    if hub is None:
        return None
    try:
        path = hub.original_snapshot_download(
            repo_id,
            revision=revision,
            local_files_only=True,
            allow_patterns=["*.safetensors", "*.json"],
        )
    except Exception:  # not cached (the client's errors vary by version)
        return None
    return Path(path)


def _on_mirror(repo_id: str, revision: str | None, settings: Settings) -> Path | None:
    """The repo's snapshot on the mirror's Hub layout, else its ``models/`` folder; the
    mirror is found by ``loaderplug_find_mirror`` with the loader's settings (its own
    mirror option included)."""
    from loaderplug.integrations.hub import mirror as hub_mirror

    plugins = Plugins(settings)
    hub_root = plugins.find_mirror(MirrorRequest("hub", repo_id, revision))
    if hub_root is not None:
        repo = hub_root / ("models--" + repo_id.replace("/", "--"))
        commit = hub_mirror.resolve_commit(repo, revision or "main")
        if commit is not None and (repo / "snapshots" / commit).is_dir():
            return repo / "snapshots" / commit
    folder = plugins.find_mirror(MirrorRequest("folder", repo_id, revision))
    return folder if folder is not None and folder.is_dir() else None


def describe(weights: ModelWeights) -> str:
    size = sum(os.path.getsize(f) for f in weights.files)
    where = f"hydrating into {weights.local_copy}" if weights.local_copy else "reading in place"
    return (
        f"{len(weights.files)} safetensors file(s), {size / MiB:.0f} MiB from {weights.folder}, "
        f"{where}"
    )
