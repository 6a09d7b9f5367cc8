"""The end of a shared load's steps: the watch on the peers stopped and every group the
load made freed, its address taken out of the store. Nothing here raises: a failure to
clean up would hide the load's own error, if there is one."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from loaderplug.tensors.ranks.collectives import abandon
from loaderplug.tensors.ranks.groups import forget_address
from loaderplug.tensors.ranks.steps import Steps

log = logging.getLogger(__name__)


def tear_down(steps: Steps, groups: list[Any]) -> None:
    """End the load's steps: stop watching the peers and free the load's groups, every
    one of them. A failure here is logged, never raised: it would hide the load's own
    error, if there is one."""
    # Past the last exchange (or failed everywhere): the peers may exit as they like.
    _quietly(steps.watch.close, "stop watching the other ranks")
    free_groups(groups, steps.pending)


def free_groups(groups: list[Any], pending: Any = None) -> None:
    """Free a load's ``groups`` (left behind, their threads abort the process at exit);
    with a collective still ``pending`` (a peer died during it), keep them for good."""
    import torch.distributed as dist

    for group in {id(g): g for g in groups}.values():
        if pending is not None:
            abandon(group, pending)
        else:
            _quietly(functools.partial(forget_address, group), "forget the address of a group")
        _quietly(functools.partial(dist.destroy_process_group, group), "free a group")


def _quietly(action: Callable[[], object], what: str) -> None:
    try:
        action()
    except Exception:
        log.warning("loaderplug: could not %s of a shared load", what, exc_info=True)
