"""One rank of a gloo group that makes two shared loads of the same files, one after the
other, every rank taken for one in a pid namespace of its own (so the ranks watch each
other by heartbeat, in the default group's store), for tests.

Usage: python heartbeat_loads.py INIT_FILE RANK WORLD SCENARIO FILE...

SCENARIO: ``named-death``: in the first load, rank 0 names rank 1 dead in the store (as
a watcher whose reads of rank 1's count stalled would), and the ranks go on;
``late-beat``: in the second load, rank 1 starts beating :data:`LATE_BEATS` silences
after the others (it reached the load late), having beaten all through the first.
``SILENT_S`` is lowered to :data:`SILENT_S` in every rank, so a silence is short.

``plain``: nothing more. ``LOADS`` (2 by default): how many loads, one after the other.

Prints {"loads": [{"tensors": how many, "error": message or null}, ...]}.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import torch.distributed as dist

from loaderplug.errors import LoaderplugError
from loaderplug.tensors.ranks import heartbeats
from loaderplug.tensors.ranks import shared as ranks
from loaderplug.tensors.ranks import world as rank_share
from loaderplug.tensors.ranks.heartbeats import Heartbeats, Peer
from loaderplug.tensors.reader import iter_tensors

SILENT_S = 2.0
LATE_BEATS = 3  # how many silences rank 1 starts late in ``late-beat``
loads_done = 0


class NamingDeath(Heartbeats):
    """Rank 0's heartbeats of the first load, which name rank 1 dead at their first beat."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if loads_done == 0 and self._rank == 0:
            self.tell(Peer(1, None))


def late_watch(*args: Any, **kwargs: Any) -> Any:
    """Rank 1's watch of the second load, started late: its first beat comes late."""
    if loads_done == 1:
        time.sleep(LATE_BEATS * SILENT_S)
    return watch(*args, **kwargs)


watch = ranks.watch


def load(files: list[str]) -> dict[str, Any]:
    said: dict[str, Any] = {"tensors": 0, "error": None}
    try:
        for _ in iter_tensors(files, "cpu", group=dist.group.WORLD):
            said["tensors"] += 1
    except LoaderplugError as exc:
        said["error"] = f"{type(exc).__name__}: {exc}"
    return said


def main() -> int:
    global loads_done
    init, rank, world, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    files = sys.argv[5:]
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    # A pid namespace of its own, as far as the ranks can tell: watched by heartbeat.
    rank_share.pid_namespace = lambda: f"pid:[{rank}]"  # type: ignore[assignment]
    heartbeats.SILENT_S = SILENT_S  # type: ignore[misc]
    if scenario == "named-death":
        rank_share.Heartbeats = NamingDeath  # type: ignore[misc]
    elif scenario == "late-beat" and rank == 1:
        ranks.watch = late_watch  # type: ignore[assignment]
    said = []
    for _ in range(int(os.environ.get("LOADS", "2"))):
        said.append(load(files))
        loads_done += 1
    print(json.dumps({"loads": said}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
