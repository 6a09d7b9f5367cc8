"""One collective of a shared load, and what its failure means: a rank that stopped
answering (dead, or stuck past ``LOADERPLUG_DISTRIBUTED_TIMEOUT_S``) is a clear
:class:`DistributedError` rather than a backend's error."""

from __future__ import annotations

import datetime
from typing import Any

from loaderplug.errors import DistributedError, LoaderplugError

# How long one slice of a wait is: the most a death can go unnoticed in a wait.
WAKE = datetime.timedelta(milliseconds=250)


def collective(op: Any, *args: Any, **kwargs: Any) -> Any:
    """A collective; a rank that stopped answering (dead, or stuck past the timeout) is
    a clear error rather than a backend's."""
    try:
        return op(*args, **kwargs)
    except RuntimeError as exc:
        if isinstance(exc, LoaderplugError):
            raise
        raise stopped_answering(exc) from exc


def completed_well(work: Any) -> bool:
    """Whether a completed collective succeeded: waiting for it again returns at once
    if it did, and raises its error if it failed."""
    try:
        work.wait(timeout=WAKE)
    except RuntimeError:
        return False
    return True


def abandon(group: Any, work: Any) -> None:
    """Keep ``group`` and its ``work`` alive for good. A collective left pending when a
    peer died is not always failed by gloo (a receive from the dead rank can wait for
    the whole timeout), and freeing its group joins gloo's thread, which waits for that
    receive: the rank would hang where it raised, or at exit, for up to ten minutes.
    Never freed, the group costs a thread and a few sockets until the process ends."""
    import ctypes

    for kept in (group, work):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))


def stopped_answering(exc: BaseException) -> DistributedError:
    return DistributedError(
        f"a rank of the shared load stopped answering ({exc}); it may have died, or be "
        f"slower than LOADERPLUG_DISTRIBUTED_TIMEOUT_S allows"
    )
