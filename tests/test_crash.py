"""kill -9 at random points of hydrate, sync and the one pass, and a soak under error
storms: nothing published is ever partial or mixed, and a rerun cleans up."""

from __future__ import annotations

import errno
import os
import random
import shutil
from pathlib import Path

import pytest

from loaderplug import hookimpl, hydrate, plugins, sync
from loaderplug.source import PosixSource
from loaderplug.testing.model import write_model
from loaderplug.types import IOPolicy
from loaderplug.units import MiB
from tests.conftest import FAST, leftover_temps, tree_bytes
from tests.helpers.crash import files_of, kill_trial

TRIALS = int(os.environ.get("LOADERPLUG_CRASH_TRIALS", "3"))


def two_generations(tmp_path: Path) -> tuple[Path, Path]:
    old, new = tmp_path / "old", tmp_path / "new"
    write_model(old, 8 * MiB, shards=4, seed=1)
    write_model(new, 8 * MiB, shards=4, seed=2)  # the same names, other bytes
    return old, new


def assert_trials(trials: list[object]) -> None:
    for trial in trials:
        assert trial.published_ok and trial.rerun_ok, trial  # type: ignore[attr-defined]


def test_hydrate_killed_at_random_points(tmp_path: Path) -> None:
    _, new = two_generations(tmp_path)
    mirror = tmp_path / "mirror"
    sync(new, mirror, **FAST)
    rng = random.Random(1)
    trials = []
    for n in range(TRIALS):
        local = tmp_path / f"local{n}"
        args = ["hydrate", "--from", str(mirror), "--to", str(local)]
        trials.append(kill_trial(args, mirror, local, [files_of(new)], rng, delay_s=0.05))
    assert_trials(trials)


@pytest.mark.parametrize("over_an_older_one", [False, True])
def test_sync_killed_at_random_points(tmp_path: Path, over_an_older_one: bool) -> None:
    old, new = two_generations(tmp_path)
    rng = random.Random(2)
    trials = []
    for n in range(TRIALS):
        mirror = tmp_path / f"mirror{n}"
        if over_an_older_one:
            sync(old, mirror, **FAST)
        args = ["sync", "--from", str(new), "--to", str(mirror)]
        trial = kill_trial(args, new, mirror, [files_of(old), files_of(new)], rng, delay_s=0.05)
        trials.append(trial)
    assert_trials(trials)


def test_one_pass_killed_at_random_points(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _, new = two_generations(tmp_path)
    rng = random.Random(3)
    trials = []
    shards = {k: v for k, v in files_of(new).items() if k.endswith(".safetensors")}
    for n in range(TRIALS):
        local = tmp_path / f"local{n}"
        args = ["load", "--from", str(new), "--to", str(local)]
        trial = kill_trial(args, new, local, [shards], rng, most_s=4)
        # A one pass publishes the weights only; compare those.
        trials.append(trial)
    for trial in trials:
        assert trial.published_ok, trial
        assert "rerun exited" not in trial.detail and "left behind" not in trial.detail, trial


class Storm:
    """Transient errors on a random share of reads, as an overloaded volume gives."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.rng = random.Random(seed)
        self.injected = 0

    @hookimpl
    def loaderplug_open_source(self, path: str, policy: IOPolicy) -> PosixSource:
        storm = self

        class Stormy(PosixSource):
            def pread_into(self, buf: memoryview, offset: int) -> int:
                if storm.rng.random() < storm.rate:
                    storm.injected += 1
                    code = storm.rng.choice((errno.ENOMEM, errno.EIO, errno.EAGAIN))
                    raise OSError(code, os.strerror(code), path)
                return super().pread_into(buf, offset)

        return Stormy(path, policy)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_soak_of_hydrates_under_error_storms_publishes_only_whole_files(
    model: Path, tmp_path: Path
) -> None:
    rounds = int(os.environ.get("LOADERPLUG_SOAK_ROUNDS", "10"))
    rng = random.Random(4)
    want = tree_bytes(model)
    fds, rss = [], []
    for n in range(rounds):
        storm = Storm(rng.uniform(0.05, 0.30), seed=n)
        plugins.register(storm)
        local = tmp_path / "local"
        try:
            report = hydrate(model, local, check=False, **FAST)
        finally:
            plugins.unregister(storm)
        got = tree_bytes(local)
        failed = {r.path for r in report.failed}
        assert all(got[rel] == want[rel] for rel in got), "a corrupt file was published"
        assert set(got) | failed == set(want) and not (set(got) & failed)
        assert leftover_temps(local) == []
        shutil.rmtree(local)
        fds.append(open_descriptors())
        rss.append(resident_bytes())
    assert max(fds) == min(fds), fds  # no descriptor leaked
    assert max(rss) - min(rss) < 32 * MiB, rss  # memory flat
