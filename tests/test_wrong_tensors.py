"""Never a wrong tensor: loads through every path of one process while one of their
files is replaced by a rename, truncated or grown at a random point
(:mod:`tests.helpers.hunt`). Every file's tensors equal one whole version of it, or the
load raises a loaderplug error.

The trials are seeded: a failure prints the seed, and ``HUNT_SEED=<seed>`` replays it.
``HUNT_TRIALS`` sets the trials per path and change (2 by default; a few hundred in all
is the hunt's full run).
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import loaderplug
from loaderplug.devices.pinned import pool_of
from loaderplug.testing.fake_device import FakeDevice, FakeDevicePlugin
from tests.helpers.hunt import CHANGES, Versions, run_trial, write_versions, wrong_tensors
from tests.helpers.ranks import run_ranks

pytest.importorskip("torch")
pytest.importorskip("safetensors")

TRIALS = int(os.environ.get("HUNT_TRIALS", "2"))
SEED = int(os.environ.get("HUNT_SEED", random.SystemRandom().randrange(1 << 32)))

# How each path is asked for: the settings of the load, and how it is set up.
PATHS: dict[str, dict[str, Any]] = {
    # A user's warm file on a local filesystem: mapped, as safetensors does.
    "mapped warm": {"owned": "auto"},
    # Cold: mapped with its pages asked ahead, or read with O_DIRECT, as the policy says.
    "mapped cold": {"owned": "auto", "cold": True},
    # Every file read into memory of the load's own, by the process's readers.
    "owned": {"owned": "own"},
    # Every file mapped, wherever it lives.
    "mapped everywhere": {"owned": "map"},
    # The range engine: direct reads, many spans a file.
    "engine": {"owned": "own", "direct_io": "on", "span_bytes": "64K", "split_threshold_bytes": 0},
    # Hydrate and load in one pass into a local copy.
    "one pass": {"owned": "auto", "one_pass": True},
    # To a device with a backend (the stand-in for CUDA): pinned reads, copies to it.
    "device": {"owned": "auto", "device": True},
}


def _evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (they are clean: written and synced)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _loader(how: dict[str, Any], folder: Path) -> Callable[[list[Path]], Iterator[tuple[str, Any]]]:
    settings = {k: v for k, v in how.items() if k not in ("cold", "one_pass", "device")}

    def load(paths: list[Path]) -> Iterator[tuple[str, Any]]:
        if how.get("cold"):
            _evict(paths)
        local = folder / "local" if how.get("one_pass") else None
        device = "cuda" if how.get("device") else "cpu"
        return iter(
            loaderplug.iter_tensors(paths, device, local_dir=local, progress=False, **settings)
        )

    return load


@pytest.fixture
def fake_cuda(register_plugin: Any) -> Iterator[FakeDevice]:
    fake = FakeDevice(delay_s=0.0)
    register_plugin(FakeDevicePlugin(fake))
    pool = pool_of(fake)
    yield fake
    pool.clear()


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("path", list(PATHS))
def test_a_file_changed_mid_load_gives_one_whole_version_or_a_clear_error(
    tmp_path: Path, path: str, change: str, request: pytest.FixtureRequest
) -> None:
    how = PATHS[path]
    if how.get("device"):
        request.getfixturevalue("fake_cuda")
    seed = SEED ^ zlib.crc32(f"{path}/{change}".encode())
    failures = []
    for trial in range(TRIALS):
        rng = random.Random(seed + trial)
        folder = tmp_path / f"trial{trial}"
        versions = write_versions(folder / "model", rng)
        outcome = run_trial(_loader(how, folder), versions, rng, change)
        wrong = wrong_tensors(outcome, versions)
        if wrong:
            failures.append(f"trial {trial} (HUNT_SEED={SEED}): {'; '.join(wrong)}")
    assert not failures, f"{path}, a file {change}d mid-load:\n" + "\n".join(failures)


def _recorded(tensors: dict[str, Any]) -> dict[str, list[Any]]:
    """Tensors as a rank records them (tests/helpers/rank_load.py): dtype, shape, crc32."""
    import torch

    out = {}
    for name, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        out[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), zlib.crc32(raw)]
    return out


def _wrong_on_rank(out: dict[str, Any], versions: Versions) -> list[str]:
    """What is wrong with what one rank of a shared load handed over (see
    :func:`tests.helpers.hunt.wrong_tensors`)."""
    if "exit" in out:
        return [f"exited {out['exit']} without a loaderplug error: {out['stderr'][-400:]}"]
    wrong = []
    for path in versions.paths:
        versions_of = [_recorded(versions.first[path.name]), _recorded(versions.second[path.name])]
        taken = {n: t for n, t in out["tensors"].items() if n in versions_of[0]}
        if out.get("error") is None and set(taken) != set(versions_of[0]):
            wrong.append(f"{path.name}: not every tensor handed over")
        elif not any(all(v[n] == t for n, t in taken.items()) for v in versions_of):
            wrong.append(f"{path.name}: tensors of neither version or of both")
    return wrong


@pytest.mark.distributed
@pytest.mark.slow("two ranks a trial, processes that import torch")
@pytest.mark.parametrize("sharing", ["pagecache", "stream", "broadcast"])
def test_a_file_replaced_mid_shared_load_gives_every_rank_one_whole_version_or_an_error(
    tmp_path: Path, sharing: str
) -> None:
    """Ranks sharing a load, one of which has a file renamed over at a random tensor
    (the others may be mapping it, or about to)."""
    seed = SEED ^ zlib.crc32(f"ranks/{sharing}".encode())
    failures = []
    for trial in range(TRIALS):
        rng = random.Random(seed + trial)
        folder = tmp_path / f"trial{trial}"
        versions = write_versions(folder / "model", rng)
        total = sum(len(v) for v in versions.first.values())
        victim, rank = rng.choice(versions.paths), rng.randrange(2)
        staged = victim.with_name(victim.name + ".landing")
        os.link(str(victim) + ".next", staged)
        at = rng.randint(1, total)
        per_rank = {rank: {"RANK_REPLACE": f"{at}:{victim}:{staged}"}}
        env = {"LOADERPLUG_RANK_SHARING": sharing, "LOADERPLUG_LOCAL_COPIES": str(folder)}
        outs, _ = run_ranks(folder, versions.paths, 2, env, per_rank, timeout_s=120)
        for r, out in enumerate(outs):
            for wrong in _wrong_on_rank(out, versions):
                failures.append(f"trial {trial} (HUNT_SEED={SEED}) rank {r}: {wrong}")
    assert not failures, f"{sharing}, a file replaced mid-load:\n" + "\n".join(failures)
