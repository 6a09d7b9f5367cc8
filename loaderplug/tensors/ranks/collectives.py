"""One collective of a shared load, and what its failure means: a rank that stopped
answering (dead, or stuck past ``LOADERPLUG_DISTRIBUTED_TIMEOUT_S``) is a clear
:class:`DistributedError` rather than a backend's error."""

from __future__ import annotations

import datetime
import threading
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
    """Keep ``group`` and its ``work`` until the process ends. A collective left pending
    when a peer died is not always failed by gloo (a receive from a rank whose sockets
    outlive it, held open by a child it forked, waits for the whole timeout), and
    freeing its group joins gloo's threads, which wait for that receive: the rank would
    hang where it raised, or at exit, for up to ``LOADERPLUG_DISTRIBUTED_TIMEOUT_S``.
    gloo's own ``abort`` (torch 2.13) leaves such a receive waiting, so nothing ends it
    early; kept, the group costs a thread and a few sockets until the process ends."""
    with _ABANDONED_LOCK:
        _ABANDONED.append((group, work))
        if not _KEEPER:
            keeper = threading.Thread(
                target=_keep, args=(_ABANDONED,), name="loaderplug-abandoned", daemon=True
            )
            keeper.start()
            _KEEPER.append(keeper)


# The collectives given up on, and the thread that keeps them (see :func:`abandon`).
_ABANDONED: list[tuple[Any, Any]] = []
_ABANDONED_LOCK = threading.Lock()
_KEEPER: list[threading.Thread] = []


def _keep(kept: list[tuple[Any, Any]]) -> None:
    """Hold ``kept`` for as long as the process runs. A module's own list is not enough:
    the interpreter clears modules as it shuts down, which would free the groups and
    join their threads; a daemon thread's frame is never cleared, so what it holds is
    never freed and the process exits at once."""
    threading.Event().wait()
    raise AssertionError(f"unreachable: {len(kept)} collectives let go")


def stopped_answering(exc: BaseException) -> DistributedError:
    return DistributedError(
        f"a rank of the shared load stopped answering ({exc}); it may have died, or be "
        f"slower than LOADERPLUG_DISTRIBUTED_TIMEOUT_S allows"
    )
