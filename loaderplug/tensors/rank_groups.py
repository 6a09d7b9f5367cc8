"""The process groups a load makes, named alike on every member.

A group made with ``use_local_synchronization=True`` (only its members take part, so a
host's ranks make theirs without the others) is named by torch from its ranks and the
number of groups the calling process holds at that moment. Two members that hold a
different number of groups (a leader of a host of two ranks holds that host's group, a
host's only rank holds none) name it differently, and each waits for the other in a
rendezvous nobody else joins, until the timeout. So every member first says how many
groups it holds (gathered on a group they already share), and those that hold fewer
make throwaway groups of themselves up to the most, make the group, and free the
throwaways: every member names the group alike, whatever its history, and the count of
groups each process holds afterwards is what it was plus the group.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any


def groups_held() -> int:
    """How many process groups this process holds (what torch names a new group by)."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    return len(names) if names is not None else 0


def agreed_group(
    members: Sequence[int], held: Sequence[int], timeout_s: float, backend: str = "gloo"
) -> Any:
    """A group of ``members`` (ranks in the default group, this rank among them), made
    by them alone; ``held`` is each member's :func:`groups_held`, in the order of
    ``members``, as gathered just before."""
    import torch.distributed as dist

    me = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    pads = [
        dist.new_group([me], timeout=timeout, backend="gloo", use_local_synchronization=True)
        for _ in range(max(held) - groups_held())
    ]
    try:
        return dist.new_group(
            list(members), timeout=timeout, backend=backend, use_local_synchronization=True
        )
    finally:
        for pad in pads:
            dist.destroy_process_group(pad)
