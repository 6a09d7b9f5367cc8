"""kill -9 at random points of hydrate, sync and the one pass, and a soak under error
storms: nothing published is ever partial or mixed, and a rerun cleans up."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from loaderplug import sync
from loaderplug.testing.crash import files_of, kill_trial, soak
from loaderplug.testing.model import write_model
from loaderplug.units import MiB
from tests.conftest import FAST

pytestmark = pytest.mark.crash
# The soak runs in this process in under a second: the edit loop keeps it.
KILLS = pytest.mark.slow("kills jobs at many points, a process each")

TRIALS = int(os.environ.get("LOADERPLUG_CRASH_TRIALS", "3"))


def two_generations(tmp_path: Path) -> tuple[Path, Path]:
    old, new = tmp_path / "old", tmp_path / "new"
    write_model(old, 8 * MiB, shards=4, seed=1)
    write_model(new, 8 * MiB, shards=4, seed=2)  # the same names, other bytes
    return old, new


def assert_trials(trials: list[object]) -> None:
    for trial in trials:
        assert trial.published_ok and trial.rerun_ok, trial  # type: ignore[attr-defined]


@KILLS
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


@KILLS
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


@KILLS
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


def test_a_soak_of_hydrates_under_error_storms_publishes_only_whole_files(
    model: Path, tmp_path: Path
) -> None:
    rounds = int(os.environ.get("LOADERPLUG_SOAK_ROUNDS", "10"))
    result = soak(model, tmp_path / "local", rounds, seed=4, **FAST)
    assert result.corrupt == 0 and result.partial == 0, result
    assert result.retries > 0  # the storms were real
    fds, rss = result.descriptors, result.resident
    assert max(fds) == min(fds), fds  # no descriptor leaked
    assert max(rss) - min(rss) < 32 * MiB, rss  # memory flat
