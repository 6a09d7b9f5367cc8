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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from loaderplug.tensors.ranks.collectives import collective

# How the members of a group about to be made hear what each holds: this process's
# count of groups said to every rank of a group they already share, every rank's count
# heard back, by rank in the default group (see :func:`over` and :func:`agreed_group`).
Gather = Callable[[int], Mapping[int, int]]


def groups_held() -> int:
    """How many process groups this process holds (what torch names a new group by)."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    return len(names) if names is not None else 0


def agreed_group(
    members: Sequence[int], gather: Gather, timeout_s: float, backend: str = "gloo"
) -> Any:
    """A group of ``members`` (ranks in the default group), made by them alone, named
    alike on each of them. Every rank of the group ``gather`` runs on calls this, as
    it takes part in the gather: each says how many groups it holds now, and those in
    ``members`` make the group and get it; the others (``members`` empty, or without
    this rank: a rank that makes no group, or whose host makes its own) get None."""
    import torch.distributed as dist

    # Counted here, just before the group is made: a count gathered earlier is stale
    # once this process made or freed a group since.
    held = gather(groups_held())
    if dist.get_rank() not in members:
        return None
    timeout = datetime.timedelta(seconds=timeout_s)
    pads = [
        dist.new_group(
            [dist.get_rank()], timeout=timeout, backend="gloo", use_local_synchronization=True
        )
        for _ in range(max(held[m] for m in members) - groups_held())
    ]
    try:
        return dist.new_group(
            list(members), timeout=timeout, backend=backend, use_local_synchronization=True
        )
    finally:
        for pad in pads:
            dist.destroy_process_group(pad)


def over(group: Any) -> Gather:
    """The gather of :func:`agreed_group` as one collective on ``group`` (a torch
    process group every rank of which calls :func:`agreed_group`)."""
    import torch.distributed as dist

    def gather(mine: int) -> dict[int, int]:
        said: list[Any] = [None] * dist.get_world_size(group)
        collective(dist.all_gather_object, said, mine, group=group)
        return {dist.get_global_rank(group, r): n for r, n in enumerate(said)}

    return gather


def forget_address(group: Any) -> None:
    """Take the address this rank published to make ``group`` out of the store, once
    the group is made on every member (so no member still needs it) and is being freed.

    The next load's group of the same members bears the same name (torch names it by
    its ranks and the groups each process holds, which is again what it was), and a
    member that read another's address before that one published it anew would connect
    to the freed group's, and fail ("Connection refused") or wait for good. Gloo keeps
    the address at ``{name}/cpu/0/{rank}`` in the default group's store; where torch
    keeps it elsewhere this removes nothing, and the store says so (False)."""
    import torch.distributed as dist

    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if default_store is None or dist.get_backend(group) != "gloo":
        return
    prefix = dist.distributed_c10d.PrefixStore
    # Nested as torch nests them: each PrefixStore puts a "/" after its prefix.
    store = prefix("cpu/", prefix(f"{group.group_name}/", default_store()))
    store.delete_key(f"0/{group.rank()}")
