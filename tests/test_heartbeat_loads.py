"""Every shared load's heartbeats are its own: what one load left in the store (a death
it named, a count that stood still at its end) never reaches the next load of the same
ranks, whose group bears the same name."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from loaderplug.testing.model import write_model
from loaderplug.units import MiB
from tests.helpers.ranks import RANK_ENV, REPO

pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("torch.distributed")

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow("ranks in processes of their own that import torch, two loads each"),
]

HELPER = Path(__file__).parent / "helpers" / "heartbeat_loads.py"
TENSORS = 4 * 8  # of the model below


def two_loads(
    tmp_path: Path, scenario: str, world: int = 2, loads: int = 2
) -> list[dict[str, Any]]:
    """What each rank said of its loads, two by default (see
    ``tests/helpers/heartbeat_loads.py``)."""
    folder = tmp_path / "model"
    write_model(folder, 2 * MiB, shards=4, tensors_per_shard=8)
    files = [str(f) for f in sorted(folder.glob("*.safetensors"))]
    init = tmp_path / f"init-{time.monotonic_ns()}"
    env = {
        **RANK_ENV,
        "LOADERPLUG_LOCAL_COPIES": str(tmp_path),
        # A rank left alone in a collective gives up in a minute, not the default ten.
        "LOADERPLUG_DISTRIBUTED_TIMEOUT_S": "60",
        "LOADS": str(loads),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPER), str(init), str(r), str(world), scenario, *files],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    said = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert out.strip(), (proc.returncode, err)
            said.append(json.loads(out))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return said


def test_a_death_named_in_one_load_leaves_the_next_load_free(tmp_path: Path) -> None:
    """Rank 0 names rank 1 dead in the store during the first load (as a watcher whose
    store stalled would); the second load of the same ranks starts afresh and completes."""
    said = two_loads(tmp_path, "named-death")
    for rank, out in enumerate(said):
        assert out["loads"][1] == {"tensors": TENSORS, "error": None}, (rank, out)


def test_a_late_first_beat_in_the_next_load_is_not_a_death(tmp_path: Path) -> None:
    """Rank 1 beat all through the first load, then starts beating in the second only
    after the others have waited several silences: a count left by the first load
    would stand still all that time; the second load's count is its own, and a rank
    that has not beaten yet in it is waited for."""
    said = two_loads(tmp_path, "late-beat")
    for rank, out in enumerate(said):
        assert out["loads"] == [{"tensors": TENSORS, "error": None}] * 2, (rank, out)


def test_loads_one_after_another_each_make_their_group_afresh(tmp_path: Path) -> None:
    """Four loads of the same ranks, one after the other: each load's group bears the
    name of the last one's, and no rank is sent to the address the freed one left in the
    store (where, before, about one pair of loads in two failed to connect, or hung)."""
    said = two_loads(tmp_path, "plain", loads=4)
    for rank, out in enumerate(said):
        assert out["loads"] == [{"tensors": TENSORS, "error": None}] * 4, (rank, out)
