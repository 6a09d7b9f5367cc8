"""A mark on a mirror that a sync is writing it, which works where flock does not.

A sync replaces a mirror's files one by one and writes the manifest last; until then the
mirror is a mix of two generations, or, on a first sync, a model with files missing.
So before it touches anything a sync creates ``.loaderplug-sync`` at the mirror's root
(``O_EXCL``, which NFS and FUSE honour where their locks may not), refreshes its mtime
every few seconds while it runs, and removes it after the manifest. A hydrate that finds
the mark waits for the sync to finish (``LOADERPLUG_SYNC_WAIT_S``); one that finds a mark
nobody refreshed for ``LOADERPLUG_SYNC_STALE_S`` (a syncer that died), or one a syncer
left when it failed, refuses the mirror: it would publish an incomplete or mixed model.
A second sync waits for the first, so the manifest always matches the files it lists;
it takes over a dead syncer's mark.

The mark is read and refreshed like any file of the mirror: a transient error (a stale
NFS handle, EIO or ENOMEM under load) is retried, and only a mark proven to be another
syncer's (another token) or gone is "not mine". Taking one failed read for a lost mark
would stop the refresh (the mark then goes stale and the mirror is refused) or leave the
mark of a sync that succeeded.

The mark's name is on a shared volume, where anything may have been put: it is created
``O_EXCL | O_NOFOLLOW``, read and touched only as a regular file of at most
:data:`MARK_BYTES` (never through a link, never a FIFO, whose open would block), and
replaced through a file created new (:mod:`loaderplug.storage.state_files`). Anything
else at its name is refused at once: a hydrate or a sync then fails, naming it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from loaderplug.engine.retry import Cancelled, GiveUp, RetryPolicy, as_raised, retrying
from loaderplug.errors import MirrorError
from loaderplug.jobs.model_folder import SYNC_MARK_NAME as MARK_NAME
from loaderplug.storage.files import write_atomically
from loaderplug.storage.state_files import UnsafeFile, open_regular, read_capped

POLL_S = 0.2
# The most a mark holds: a host name, a PID, a date and a token as JSON take a few
# hundred bytes; a larger one was not written by loaderplug, and is not read.
MARK_BYTES = 4096
# A mark is read like any file of the mirror: with the default retry policy.
READ_RETRY = RetryPolicy()


@dataclass(frozen=True)
class Mark:
    """A mark as found: who made it, how long ago it was refreshed, whether it was left
    by a sync that failed."""

    owner: str
    age_s: float
    abandoned: bool

    def live(self, stale_s: float) -> bool:
        return not self.abandoned and self.age_s < stale_s


def read_mark(path: Path, retry: RetryPolicy = READ_RETRY) -> Mark | None:
    """The mark at ``path``, or None where there is none. A transient error is retried;
    one that persists, or any other, raises :class:`MirrorError`."""

    try:
        (raw, st), _ = retrying(lambda: _read(path), retry, _cannot_read(path))
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw.decode("utf-8"))
        owner = f"{data['host']} pid {data['pid']}, since {data['started']}"
        abandoned = bool(data.get("abandoned"))
    except (ValueError, KeyError, TypeError):
        owner, abandoned = "an unknown syncer", False  # half-written: judged by its age
    return Mark(owner, max(0.0, time.time() - st.st_mtime), abandoned)


def _read(path: Path) -> tuple[bytes, os.stat_result]:
    return read_capped(path, MARK_BYTES, "a sync mark")


def _cannot_read(path: Path) -> GiveUp:
    """What reading the mark at ``path`` raises when it gives up: FileNotFoundError where
    the mark is gone (no mark, which callers expect), else a MirrorError."""

    def give_up(exc: OSError, attempts: int | None) -> Exception:
        if isinstance(exc, FileNotFoundError):
            return as_raised(exc, attempts)
        if isinstance(exc, UnsafeFile):
            return MirrorError(
                f"{path}: {exc.strerror}; a sync mark is a small regular file that "
                f"`loaderplug sync` writes: remove what is there, then sync the mirror again"
            )
        tried = f"after {attempts} attempts" if attempts else "not a transient error"
        return MirrorError(
            f"{path}: could not read this sync mark ({exc.strerror}, errno {exc.errno}, "
            f"{tried}); check that the volume is mounted and readable, then retry"
        )

    return give_up


def wait_for_sync(
    mirror: Path,
    wait_s: float,
    stale_s: float,
    sleep: Callable[[float], None] = time.sleep,
    retry: RetryPolicy = READ_RETRY,
) -> None:
    """Return once no sync is writing ``mirror``; raise if one died or failed there, or
    is still writing after ``wait_s``."""
    started = time.monotonic()
    while (mark := read_mark(mirror / MARK_NAME, retry)) is not None:
        if mark.abandoned:
            raise MirrorError(
                f"{mirror}: a sync ({mark.owner}) failed while writing this mirror, which is "
                f"incomplete or mixes two versions; run `loaderplug sync` to it again"
            )
        if not mark.live(stale_s):
            raise MirrorError(
                f"{mirror}: a sync ({mark.owner}) died while writing this mirror (its mark "
                f"was last refreshed {mark.age_s:.0f} s ago), which is incomplete or mixes "
                f"two versions; run `loaderplug sync` to it again"
            )
        if time.monotonic() - started >= wait_s:
            raise MirrorError(
                f"{mirror}: a sync ({mark.owner}) is still writing this mirror after "
                f"{wait_s:g} s; retry when it is done, or raise LOADERPLUG_SYNC_WAIT_S"
            )
        sleep(POLL_S)


class SyncMark(contextlib.AbstractContextManager["SyncMark"]):
    """The mark of this process's sync of ``mirror``, for a ``with`` block: taken on
    entry (after any other live sync), refreshed while held, removed on a clean exit and
    left ``abandoned`` on an exception (the mirror is then not whole)."""

    def __init__(
        self, mirror: Path, wait_s: float, stale_s: float, retry: RetryPolicy = READ_RETRY
    ) -> None:
        self.mirror = mirror
        self.path = mirror / MARK_NAME
        self.wait_s = wait_s
        self.stale_s = stale_s
        self.retry = retry
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._heart: threading.Thread | None = None

    def __enter__(self) -> SyncMark:
        self.mirror.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        while not self._create():
            mark = read_mark(self.path, self.retry)
            if mark is not None and not mark.live(self.stale_s):
                self._take_over()
                continue
            if time.monotonic() - started >= self.wait_s:
                owner = mark.owner if mark else "another syncer"
                raise MirrorError(
                    f"{self.mirror}: another sync ({owner}) is still writing this mirror "
                    f"after {self.wait_s:g} s; retry when it is done"
                )
            time.sleep(POLL_S)
        self._heart = threading.Thread(target=self._beat, name="loaderplug-sync-mark", daemon=True)
        self._heart.start()
        return self

    def _create(self) -> bool:
        body = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "token": self.token,
        }
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(self.path, flags, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(body, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _take_over(self) -> None:
        """Move a dead syncer's mark aside; if what moved was someone's fresh mark (it
        was replaced meanwhile), put it back."""
        aside = self.path.with_name(f"{MARK_NAME}.{self.token}.stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        mark = read_mark(aside, self.retry)
        if mark is not None and mark.live(self.stale_s):
            with contextlib.suppress(OSError):
                # No clobbering: fails if another mark is there.
                os.link(aside, self.path, follow_symlinks=False)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)

    def _beat(self) -> None:
        # Refreshed several times within the staleness limit: one slow write is no death.
        # A mark another syncer took over (this one was thought dead) is its own: this
        # heart stops rather than keep it alive. A mark it cannot read or touch even
        # after retries is not proven lost: the next beat tries again.
        every = max(0.5, min(5.0, self.stale_s / 4))
        while not self._stop.wait(every):
            try:
                if not self._refresh():
                    return
            except Cancelled:
                return
            except (MirrorError, OSError):
                continue

    def _refresh(self) -> bool:
        """Touch the mark if it is still this syncer's; False once it is not."""
        if self._own(cancel=self._stop) is None:
            return False
        try:
            retrying(lambda: _touch(self.path), self.retry, as_raised)
        except FileNotFoundError:
            return False
        return True

    def _own(self, cancel: threading.Event | None = None) -> dict[str, object] | None:
        """The mark's content while it is still this syncer's; None once it is proven
        not to be: gone, or another token (a half-written mark is another syncer's
        being made: this one's was written whole before it was used). A read that keeps
        failing raises :class:`MirrorError`: the mark's owner is then unknown."""
        try:
            (raw, _), _ = retrying(
                lambda: _read(self.path), self.retry, _cannot_read(self.path), cancel=cancel
            )
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError:
            return None
        return data if isinstance(data, dict) and data.get("token") == self.token else None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._heart is not None:
            self._heart.join()
        try:
            data = self._own()
        except MirrorError as error:
            if kind is None:
                raise self._left_behind(error) from error
            return  # the sync's own error says more; its mark goes stale, then is refused
        if data is None:  # taken over by a syncer that thought this one dead: its mark
            return
        if kind is None:
            with contextlib.suppress(FileNotFoundError):
                retrying(lambda: os.unlink(self.path), self.retry, as_raised)
            return
        # Left for hydrates to refuse at once, rather than after it goes stale; written
        # whole (a hydrate may read it at any moment).
        try:
            retrying(
                lambda: write_mark(self.path, {**data, "abandoned": True}), self.retry, as_raised
            )
        except OSError as error:
            if error.errno not in (errno.ENOENT, errno.EROFS):
                raise

    def _left_behind(self, error: MirrorError) -> MirrorError:
        return MirrorError(
            f"{self.mirror}: the sync finished, but its mark {MARK_NAME} could not be read "
            f"to remove it ({error}); if no other sync is writing this mirror, delete the "
            f"mark, or hydrates refuse the mirror once it is {self.stale_s:g} s old"
        )


def _touch(path: Path) -> None:
    """Refresh the mark's mtime through a descriptor of it: never a link's target."""
    fd = open_regular(path)
    try:
        os.utime(fd)
    finally:
        os.close(fd)


def write_mark(path: Path, data: dict[str, object]) -> None:
    """Replace the mark at ``path`` with ``data`` in one rename: a reader sees the old
    mark or the new, never a torn one."""
    part = path.with_name(f"{path.name}.{secrets.token_hex(4)}.part")
    write_atomically(path, json.dumps(data), temp=part, fsync=False)
