"""A rank whose peer died while a collective waited on it raises at once, naming the
peer, and its process then exits: the collective gloo never fails (the dead rank's
sockets held open by a child it forked) neither holds the raise nor the exit back.

Two real processes in a gloo group on a ``file://`` rendezvous; every collective has a
timeout far longer than the test's patience, so a rank that waited one out fails it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

pytestmark = [pytest.mark.distributed, pytest.mark.slow("two processes that import torch")]

REPO = Path(__file__).resolve().parents[1]
# Far past the test's patience: a rank that waits a collective out fails the test.
TIMEOUT_S = 900
PATIENCE_S = 120

RANK = textwrap.dedent(
    """
    import datetime, json, os, signal, sys, time
    import torch.distributed as dist
    from loaderplug.errors import DistributedError
    from loaderplug.settings import from_env
    from loaderplug.tensors.ranks.peers import PeerWatch
    from loaderplug.tensors.ranks.world import share_for, world_of
    from loaderplug.tensors.ranks.steps import Steps
    from loaderplug.tensors.ranks.teardown import tear_down

    init, rank = sys.argv[1], int(sys.argv[2])
    timeout = datetime.timedelta(seconds=int(os.environ["TIMEOUT_S"]))
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=2, timeout=timeout
    )
    settings = from_env(progress=False)
    share = share_for(world_of(dist.group.WORLD, settings), settings)
    steps = Steps(share, PeerWatch(share.peers))
    if rank == 1:
        child = os.fork()
        if child == 0:  # keeps this rank's sockets open: gloo sees no peer go
            nowhere = os.open(os.devnull, os.O_WRONLY)
            os.dup2(nowhere, 1)  # but not the test's pipes
            os.dup2(nowhere, 2)
            time.sleep(int(os.environ["TIMEOUT_S"]))
            os._exit(0)
        print(json.dumps({"child": child}), flush=True)
        time.sleep(1)  # rank 0 is waiting in its step by now
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        steps.exchange(("news", 0))  # rank 1 never takes this step
        said = {"error": None}
    except DistributedError as exc:
        said = {"error": str(exc), "pending": steps.pending is not None}
    finally:
        tear_down(steps, [share.group])
    print(json.dumps(said), flush=True)
    """
)


def test_a_rank_whose_peer_died_in_a_collective_raises_and_exits(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "TIMEOUT_S": str(TIMEOUT_S),
        "LOADERPLUG_DISTRIBUTED_TIMEOUT_S": str(TIMEOUT_S),
        "LOADERPLUG_PROGRESS": "0",
        "LOADERPLUG_IO_PROBE": "0",
    }
    init = tmp_path / "init"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(init), str(rank)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    child = None
    try:
        out1, err1 = procs[1].communicate(timeout=PATIENCE_S)
        assert procs[1].returncode == -signal.SIGKILL, err1
        child = json.loads(out1.splitlines()[0])["child"]
        out0, err0 = procs[0].communicate(timeout=PATIENCE_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if child is not None:
            os.kill(child, signal.SIGKILL)
    assert procs[0].returncode == 0, err0
    said = json.loads(out0.splitlines()[-1])
    assert said["pending"] is True  # the collective was still waiting on the dead rank
    assert "rank 1 of the shared load died" in said["error"], said
