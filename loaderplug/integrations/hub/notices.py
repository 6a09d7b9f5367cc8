"""What the Hub hook says: once per mirror, repo and reason in a process, since a load
makes many calls (a config, a tokenizer, each shard) that would each say the same."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from loaderplug.integrations.hub import commits as hub_commits

log = logging.getLogger(__name__)

_said: set[tuple[str, str, str]] = set()
_said_lock = threading.Lock()


def say_once(
    mirror: Path,
    options: dict[str, Any],
    why: str,
    message: str,
    *args: Any,
    level: int = logging.WARNING,
) -> None:
    """One warning (or a message at ``level``) per mirror, repo and reason in a process."""
    key = (str(mirror), str(options["repo_id"]), why)
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    log.log(level, message, *args)


def note_once(mirror: Path, options: dict[str, Any], why: str, message: str, *args: Any) -> None:
    """What is worth knowing on an ordinary day (a worker offline), said once at info."""
    say_once(mirror, options, why, message, *args, level=logging.INFO)


def skip(mirror: Path, options: dict[str, Any], why: str) -> None:
    """Say why the mirror is not used for this call (the original then runs)."""
    offline = hub_commits.offline(options)
    then = "huggingface_hub's own cache answers" if offline else "downloading it"
    say_once(
        mirror,
        options,
        why,
        "loaderplug: not using the mirror %s for %s: %s; %s",
        mirror,
        hub_commits.RepoRevision.of(options),
        why,
        then,
    )


def some(refused: dict[str, str]) -> str:
    """The first few refused files and why, for a message that gives their number."""
    listed = "; ".join(f"{p}: {why}" for p, why in list(refused.items())[:3])
    return listed + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")


def cause(exc: BaseException) -> str:
    """An exception as a message names its cause: its type and what it says."""
    return f"{type(exc).__name__}: {exc}"


_failures: set[tuple[str, str, str]] = set()


def failed(
    work: str, options: dict[str, Any], exc: BaseException, message: str, *args: Any
) -> None:
    """A failure of the hook's own work (``work``: serving from the mirror, filling it),
    which the call it came with never sees: a warning once per repo (and local cache) in
    a process, since a load's many calls would each fail alike; the traceback at debug,
    each time."""
    key = (work, str(options.get("cache_dir")), str(options["repo_id"]))
    with _said_lock:
        first = key not in _failures
        _failures.add(key)
    if first:
        log.warning(message, *args)
    log.debug("loaderplug: the traceback of %s's failure (%s)", work, cause(exc), exc_info=exc)
