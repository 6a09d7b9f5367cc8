"""Retrying transient IO errors, and stopping work that was cancelled.

A network volume under load answers with ENOMEM, EIO or EAGAIN, and the same request a
moment later succeeds. :func:`retrying` is the one loop every reader uses (the engine's
ranges and writes, the header read, ``bench``): exponential backoff with full jitter,
so retries from many workers spread out instead of hitting the volume in lockstep, and
a wait that ends as soon as the job is cancelled.
"""

from __future__ import annotations

import errno as errno_mod
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from loaderplug.settings import Settings

TRANSIENT_ERRNOS = frozenset({errno_mod.ENOMEM, errno_mod.EIO, errno_mod.EAGAIN, errno_mod.ESTALE})
# A stale handle (NFS, after the server replaced or moved the file) is cured by opening
# the path again, which every retry does; the reopened file's identity is checked, so a
# file truly replaced fails as changed. It says nothing about load.
LOAD_ERRNOS = TRANSIENT_ERRNOS - {errno_mod.ESTALE}
T = TypeVar("T")


class Cancelled(Exception):
    """The job was cancelled (Ctrl-C, a consumer that stopped early, a failed file)
    while this work waited or was about to start."""


def is_transient(exc: OSError) -> bool:
    return exc.errno in TRANSIENT_ERRNOS


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and how patiently, a transient error is retried."""

    attempts: int = 8
    base_ms: int = 50
    max_ms: int = 4000

    @staticmethod
    def of(settings: Settings) -> RetryPolicy:
        return RetryPolicy(settings.retry_attempts, settings.retry_base_ms, settings.retry_max_ms)

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait before retry ``attempt + 1``: exponential, with full jitter."""
        ceiling_ms = min(self.max_ms, self.base_ms * 2**attempt)
        return random.uniform(0, ceiling_ms) / 1000


# Builds the error raised when ``retrying`` gives up: the last OSError, and the number
# of attempts when it was transient (None when it was not, and never retried).
GiveUp = Callable[[OSError, "int | None"], Exception]


def as_raised(exc: OSError, attempts: int | None) -> OSError:
    """A :data:`GiveUp` for a caller that handles the ``OSError`` itself: the last error
    as it was raised (ENOENT stays a ``FileNotFoundError``)."""
    return OSError(exc.errno, exc.strerror, exc.filename)


def retrying(
    op: Callable[[], T],
    policy: RetryPolicy,
    give_up: GiveUp,
    *,
    cancel: threading.Event | None = None,
    on_transient: Callable[[OSError], None] | None = None,
    before_retry: Callable[[], None] | None = None,
) -> tuple[T, int]:
    """Run ``op`` until it succeeds; returns its result and the retries it took.

    A transient errno is retried after a backoff (``on_transient`` hears of each one,
    ``before_retry`` runs after the wait); any other ``OSError``, or the last attempt's,
    becomes ``give_up(exc, attempts)``, chained. ``cancel`` ends the loop with
    :class:`Cancelled`, before an attempt or during a backoff.
    """
    for attempt in range(policy.attempts):
        if cancel is not None and cancel.is_set():
            raise Cancelled
        try:
            return op(), attempt
        except OSError as exc:
            if not is_transient(exc):
                raise give_up(exc, None) from exc
            if attempt + 1 == policy.attempts:
                raise give_up(exc, attempt + 1) from exc
            if on_transient is not None:
                on_transient(exc)
            wait_s = policy.backoff_s(attempt)
            if cancel is not None:
                if cancel.wait(wait_s):
                    raise Cancelled from None
            elif wait_s:
                threading.Event().wait(wait_s)
            if before_retry is not None:
                before_retry()
    raise AssertionError("unreachable: attempts is at least 1")
