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
from tests.helpers.hunt import CHANGES, run_trial, write_versions, wrong_tensors

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
    "owned": {"owned": "on"},
    # Every file mapped, wherever it lives.
    "mapped everywhere": {"owned": "off"},
    # The range engine: direct reads, many spans a file.
    "engine": {"owned": "on", "direct_io": "on", "span_bytes": "64K", "split_threshold_bytes": 0},
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
