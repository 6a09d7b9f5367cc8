"""Ranks of one host in different pid namespaces (containers with the host's network and
files) cannot watch each other's processes: a rank that dies there is noticed by its
heartbeat in the group's store, and named."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loaderplug.testing.model import write_model
from loaderplug.units import MiB
from tests.helpers.ranks import HELPER, REPO

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")


def _in_own_pid_namespace_works() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare"
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "true"], capture_output=True, text=True, check=False
    )
    return None if done.returncode == 0 else f"unshare --pid: {done.stderr.strip()}"


@pytest.mark.distributed
@pytest.mark.slow("two ranks, processes that import torch")
def test_a_rank_in_another_pid_namespace_that_dies_is_named_by_its_heartbeat(
    tmp_path: Path,
) -> None:
    """Rank 1 runs in a pid namespace of its own (``unshare --pid --fork``, files and
    network shared) and dies two seconds into the load: rank 0, which cannot see its
    process, raises that it died, as its heartbeat says, rather than that it stopped
    answering (the collective's own failure)."""
    why_not = _in_own_pid_namespace_works()
    if why_not:
        pytest.skip(why_not)
    folder = tmp_path / "model"
    write_model(folder, 8 * MiB, shards=4, tensors_per_shard=16)
    files = [str(f) for f in sorted(folder.glob("*.safetensors"))]
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "LOADERPLUG_PROGRESS": "0",
        "LOADERPLUG_IO_PROBE": "0",
        "RANK_TENSOR_SLEEP_S": "0.1",  # the load lasts: rank 1 dies in the middle of it
    }
    init = tmp_path / "init"
    # Under a shell: the first process of a pid namespace ignores a SIGKILL of its own.
    own_namespace = ["unshare", "--pid", "--fork", "sh", "-c", '"$@"; exit $?', "sh"]
    procs = [
        subprocess.Popen(
            [*prefix, sys.executable, str(HELPER), str(init), str(rank), "2", *files],
            cwd=REPO,
            env={**env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, prefix, extra in [(0, [], {}), (1, own_namespace, {"RANK_DIE_AT_S": "2"})]
    ]
    try:
        out0, err0 = procs[0].communicate(timeout=240)
        assert out0.strip(), err0
        procs[1].communicate(timeout=60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    said = json.loads(out0)
    assert said["error"] is not None, said
    assert said["error"].startswith("DistributedError: rank 1 of the shared load died"), said
    assert "heartbeat" in said["error"] and "pid namespace" in said["error"]
