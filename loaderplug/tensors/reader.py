"""Streaming safetensors reader: tensors are yielded as soon as their last byte lands.

Files are read by the range engine (range-parallel, under the IO policy of each file); a
tensor sink per file (:mod:`loaderplug.tensors.delivery.tensor_sinks`) scatters every
landed range into the tensors it covers and hands over each tensor the moment it is
complete, while other ranges are still in flight. A yielded tensor is never a view into
a reused buffer: it has memory of its own, or is a view of a mapping of a file that
stays put, as safetensors' are (``LOADERPLUG_OWNED`` and
:mod:`loaderplug.tensors.delivery.map_rule` say which).

With ``local_dir`` the same pass also hydrates: each range read from the mirror is
written to a local temp file and fed to the tensor sink, so every byte is read from the
volume once. It is a job like a hydrate (:mod:`loaderplug.jobs.runner`): under the local
folder's lock, leftovers of a killed run swept, and a local copy that is current already
read from local disk instead of the mirror.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loaderplug.jobs.runner import Runner
from loaderplug.settings import Settings, from_env
from loaderplug.storage.object_urls import is_object_url
from loaderplug.tensors.delivery.load import Load, Pairs, RunnerPairs
from loaderplug.tensors.delivery.plan import load_plan
from loaderplug.tensors.device.path import device_path_for, within_device_budget
from loaderplug.tensors.hosts.split import SplitPairs, split_across_hosts
from loaderplug.tensors.ranks.files import by_name
from loaderplug.tensors.ranks.shared import share_for, shared_tensors, world_of
from loaderplug.tensors.ranks.teardown import free_groups

if TYPE_CHECKING:
    import torch


def iter_tensors(
    paths: Sequence[str | os.PathLike[str]],
    device: str | torch.device = "cpu",
    *,
    local_dir: str | os.PathLike[str] | None = None,
    group: Any = None,
    settings: Settings | None = None,
    stats: dict[str, Any] | None = None,
    **overrides: Any,
) -> Load:
    """``(name, tensor)`` from safetensors ``paths``, each as it completes.

    With ``local_dir``, each file is also hydrated there (same name) in the same pass,
    with every guarantee of a hydrate. With a ``torch.distributed`` process ``group`` of
    more than one rank on this host (or without one, the initialised default group;
    ``LOADERPLUG_DISTRIBUTED=off`` reads alone), the ranks split the files, each byte
    read once per host, and every rank yields every tensor (see
    :mod:`loaderplug.tensors.ranks.shared`). Nothing is read until the first tensor is asked
    for. To a CUDA ``device`` each range is read into pinned memory and copied to the
    device from there as it lands (:mod:`loaderplug.tensors.device.sink`). The
    returned :class:`~loaderplug.tensors.delivery.load.Load` carries the job's report, the time
    to the first tensor and how each file was read once it is exhausted
    (``stats``, a dict it fills, is the deprecated way to get them).
    """
    job_settings = settings or from_env()
    if overrides:
        job_settings = job_settings.replace(**overrides)
    if stats is not None:
        warnings.warn(
            "iter_tensors(stats=...) is deprecated: the Load it returns carries report, "
            "first_tensor_s and io_modes",
            DeprecationWarning,
            stacklevel=2,
        )

    return Load(lambda load: _start(load, paths, device, local_dir, group, job_settings), stats)


def _start(
    load: Load,
    paths: Sequence[str | os.PathLike[str]],
    device: str | torch.device,
    local_dir: str | os.PathLike[str] | None,
    group: Any,
    job_settings: Settings,
) -> Pairs:
    """The load's tensors, once the first is asked for: on this rank alone, shared by
    the host's ranks, split across hosts, or both."""
    path = device_path_for(device, job_settings)  # the one place the device is decided
    load.at_end(path.release)
    settings = within_device_budget(path, job_settings)
    world = world_of(group, settings, local_dir)
    share = share_for(world, settings)
    # Objects in a store: every host reads the store itself (its reads are not split).
    objects = any(is_object_url(p) for p in paths)
    try:
        split = None if objects else split_across_hosts(paths, local_dir, world, share, settings)
    except BaseException:
        if share is not None:
            free_groups([share.group])
        raise
    if split is not None:
        load.hosts = split
        load.at_end(split.finish)  # a load that did not complete abandons its rounds
        settings = split.load_settings(settings)
    if share is not None:
        return shared_tensors(paths, path, local_dir, settings, share, load, split)
    if split is None or split.opener is None:
        return RunnerPairs(Runner(load_plan(paths, path, settings, local_dir), settings), load)
    # The files in the order the hosts exchange them: the engine asks for each span
    # about when it arrives.
    ordered = by_name([Path(p) for p in paths])
    plan = load_plan(ordered, path, settings, local_dir, open_source=split.opener)
    return SplitPairs(RunnerPairs(Runner(plan, settings), load), split)


def load_file(
    path: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """A drop-in for ``safetensors.torch.load_file``: every tensor, whole, on ``device``."""
    return dict(iter_tensors([path], device))
