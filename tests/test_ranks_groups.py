"""A group a load makes is named alike on each of its members, whatever groups each held
before, through the one gather every maker of a group goes through; a rank of the
gathering group outside the members takes part and makes nothing; a freed group's
address leaves the store, and the same members' next group works.

Three real processes in a gloo group on a ``file://`` rendezvous."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

pytestmark = [pytest.mark.distributed, pytest.mark.slow("three processes that import torch")]

REPO = Path(__file__).resolve().parents[1]
RANKS = 3
# A bound on a hang (a rendezvous nobody else joins waits this long), not a measure.
PATIENCE_S = 120

RANK = textwrap.dedent(
    """
    import datetime, json, sys
    import torch, torch.distributed as dist
    from loaderplug.tensors.ranks.groups import agreed_group, groups_held, over
    from loaderplug.tensors.ranks.teardown import free_groups

    init, rank, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=ranks,
        timeout=datetime.timedelta(seconds=60),
    )
    # A history of its own on each rank: rank 0 holds two groups more than rank 2,
    # rank 1 one more, as a host's leader holds its host's group and others none.
    history = [
        dist.new_group([rank], backend="gloo", use_local_synchronization=True)
        for _ in range(ranks - 1 - rank)
    ]
    prefixed = dist.distributed_c10d.PrefixStore

    def address_kept(group):
        # Where gloo keeps a member's address: the default store, prefixed as torch
        # prefixes it for the group (each prefix followed by a "/" of its own).
        default = dist.distributed_c10d._get_default_store()
        store = prefixed("cpu/", prefixed(f"{group.group_name}/", default))
        return store.check([f"0/{group.rank()}"])

    def make():
        held = groups_held()
        group = agreed_group((0, 1), over(dist.group.WORLD), 60)
        said = {"held": held, "after": groups_held(), "name": None}
        if group is not None:
            ones = torch.ones(1)
            dist.all_reduce(ones, group=group)
            said |= {"name": group.group_name, "sum": ones.item(), "kept": address_kept(group)}
            dist.barrier(group=group)  # both made it: nobody needs the address any more
            free_groups([group])
            said["forgotten"] = not address_kept(group)
        return said

    loads = [make(), make()]
    dist.barrier()
    print(json.dumps(loads), flush=True)
    """
)


def test_a_group_is_named_alike_on_members_holding_different_groups(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LOADERPLUG_PROGRESS": "0"}
    init = tmp_path / "init"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(init), str(rank), str(RANKS)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(RANKS)
    ]
    said: list[list[dict[str, Any]]] = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=PATIENCE_S)
            assert proc.returncode == 0, err
            said.append(json.loads(out.splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for load in range(2):
        first, second, outside = (said[rank][load] for rank in range(RANKS))
        assert first["held"] != second["held"]  # the histories differ
        assert first["name"] is not None and first["name"] == second["name"]
        for member in (first, second):
            assert member["sum"] == 2.0  # the group works: both members in it
            assert member["kept"] and member["forgotten"]
            # Its throwaway groups freed: it holds the group and nothing more.
            assert member["after"] == member["held"] + 1
        assert outside["name"] is None and outside["after"] == outside["held"]
    # The next load's group of the same members bears the same name, and works.
    assert said[0][0]["name"] == said[0][1]["name"]
