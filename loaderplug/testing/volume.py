"""A FUSE test volume: serves a backing folder as a slow, faulty network volume.

The volume is a read-write passthrough of a backing folder whose *reads* are
throttled (per open handle and per mount token buckets, with a minimum service time per
request), can fail with injected errnos (`Fault`), and can have a file swapped
underneath a reader (`Replace`). It is meant for tests, benchmarks and demos of
code that copies model files from a network-volume mirror.

The FUSE server runs in its own process (``python -m loaderplug.testing.volume``)
so its Python request handlers never compete for the GIL of the process under
test. `mounted` starts it, waits until the mount is live, and always unmounts.

Gotchas (measured on Linux 6.x with libfuse 3.14, see the module tests):

* Files are opened with ``direct_io``, so the kernel page cache cannot hide the
  throttle. As a consequence ``mmap(MAP_SHARED)`` of a file on the volume fails
  with ENODEV (libfuse 3.14 cannot negotiate FUSE_DIRECT_IO_ALLOW_MMAP);
  ``MAP_PRIVATE`` (``mmap.ACCESS_COPY``) works and its page faults are
  ordinary (throttled) reads.
* The kernel splits one large ``pread`` into sequential FUSE read requests of
  at most ``max_pages`` (usually 1 MiB). Throttling, latency and faults apply
  per *request*, so a fault on a later chunk of a large ``pread`` shows up as a
  short read, not as an exception; only a fault on the first chunk raises.
* ``per_stream_bytes_per_s`` is per open file handle: threads sharing one fd
  share one stream's bandwidth. Open one fd per worker to get parallel streams.
* At most ``_FUSE_MAX_THREADS`` (64) requests are served at once (libfuse 3's
  default of 10 is raised via ``-o max_threads``); more wait in the kernel.
* Unlinks are real (``hard_remove``): no ``.fuse_hidden*`` files appear in the
  backing folder, but ``fstat`` on an open-then-unlinked file fails with
  ESTALE (reads and writes on it keep working).
* A client's ``O_DIRECT`` is honoured by the mount (it is direct_io anyway)
  but stripped when opening the backing file.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno as errno_mod
import fnmatch
import functools
import itertools
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

__all__ = [
    "FSTYPE",
    "Fault",
    "Replace",
    "TestVolume",
    "VolumeProfile",
    "fuse_unavailable_reason",
    "mounted",
]

MiB = 1024 * 1024

# /proc/mounts shows "fuse.<subtype>"; tests and cleanup key on this name.
SUBTYPE = "loaderplug-testvol"
FSTYPE = f"fuse.{SUBTYPE}"

# libfuse 3's multithreaded loop defaults to max_threads=10, i.e. at most 10
# requests served at once; a loader doing 16-32 parallel range reads would be
# throttled by the test volume itself rather than by the profile.
_FUSE_MAX_THREADS = 64

# utimensat(2) sentinels carried in tv_nsec; mfusepy folds them into a plain
# nanosecond count, so they must be recognised after the fact.
_UTIME_NOW = (1 << 30) - 1
_UTIME_OMIT = (1 << 30) - 2


# --------------------------------------------------------------------------
# Profile (shared by parent and server; crosses the process boundary as JSON)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """An injected read error.

    Evaluated once per FUSE read request; the first fault that matches and
    fires wins.
    """

    errno: int
    rate: float = 1.0
    path_glob: str = "*"
    max_inflight: int | None = None
    after_bytes: int = 0
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.errno <= 0:
            raise ValueError(f"Fault.errno must be a positive errno, got {self.errno}")
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"Fault.rate must be in [0, 1], got {self.rate}")
        if self.max_inflight is not None and self.max_inflight < 0:
            raise ValueError("Fault.max_inflight must be >= 0")
        if self.after_bytes < 0:
            raise ValueError("Fault.after_bytes must be >= 0")
        if self.limit is not None and self.limit < 0:
            raise ValueError("Fault.limit must be >= 0")


@dataclass(frozen=True)
class Replace:
    """Swap a backing file for another one once enough of it has been read."""

    path: str
    after_bytes: int
    with_file: str

    def __post_init__(self) -> None:
        if not os.path.isabs(self.with_file):
            raise ValueError(f"Replace.with_file must be absolute: {self.with_file}")
        if self.after_bytes < 0:
            raise ValueError("Replace.after_bytes must be >= 0")


@dataclass(frozen=True)
class VolumeProfile:
    """How slow and how faulty the volume is. Rates are in bytes per second."""

    per_stream_bytes_per_s: float | None = None
    mount_bytes_per_s: float | None = None
    latency_s: float = 0.0
    faults: tuple[Fault, ...] = ()
    replace: tuple[Replace, ...] = ()
    seed: int = 0
    # Act like a kernel that refuses direct IO: "open" fails an O_DIRECT open with
    # EINVAL, "read" accepts the open and fails every read of that handle with EINVAL.
    refuse_direct_io: str | None = None

    def __post_init__(self) -> None:
        for name in ("per_stream_bytes_per_s", "mount_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.latency_s < 0:
            raise ValueError("latency_s must be >= 0")
        # Accept lists (e.g. from hand-written code) but store tuples so the
        # profile stays hashable and immutable.
        object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "replace", tuple(self.replace))

    @classmethod
    def network_volume(cls) -> VolumeProfile:
        """A network volume: 40 MiB/s per stream, 640 MiB/s per mount, 1 ms."""
        return cls(
            per_stream_bytes_per_s=40 * MiB,
            mount_bytes_per_s=640 * MiB,
            latency_s=0.001,
        )

    @classmethod
    def object_store(cls, max_inflight: int = 16) -> VolumeProfile:
        """An object-store mount: ENOMEM once more than `max_inflight` reads."""
        return cls(
            per_stream_bytes_per_s=40 * MiB,
            mount_bytes_per_s=320 * MiB,
            latency_s=0.002,
            faults=(Fault(errno_mod.ENOMEM, max_inflight=max_inflight),),
        )

    @classmethod
    def unthrottled(cls) -> VolumeProfile:
        """A plain passthrough (FUSE overhead only)."""
        return cls()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> VolumeProfile:
        raw = json.loads(s)
        if not isinstance(raw, dict):
            raise ValueError("VolumeProfile JSON must be an object")
        faults = tuple(Fault(**f) for f in raw.pop("faults", ()))
        replace = tuple(Replace(**r) for r in raw.pop("replace", ()))
        return cls(faults=faults, replace=replace, **raw)


# --------------------------------------------------------------------------
# Server side (runs in the subprocess)
# --------------------------------------------------------------------------


class _TokenBucket:
    """A rate limiter that books time slots instead of blocking under a lock.

    `reserve` only advances a virtual clock under the lock and returns the
    deadline at which the booked bytes are "delivered"; callers sleep outside
    the lock, so many requests wait concurrently and the aggregate rate is
    still exact. No burst credit is kept: an idle bucket starts from "now".
    """

    def __init__(self, bytes_per_s: float) -> None:
        self._rate = bytes_per_s
        self._lock = threading.Lock()
        self._tat = 0.0  # theoretical arrival time of the last booked byte

    def reserve(self, nbytes: int, now: float) -> float:
        with self._lock:
            self._tat = max(self._tat, now) + nbytes / self._rate
            return self._tat


class _Handle:
    __slots__ = ("bucket", "fd", "flags", "generation", "lock", "rel", "stale_fds")

    def __init__(
        self, fd: int, rel: str, flags: int, generation: int, bucket: _TokenBucket | None
    ) -> None:
        self.fd = fd
        self.rel = rel
        self.flags = flags
        self.generation = generation
        self.bucket = bucket
        self.lock = threading.Lock()
        # fds replaced by a reopen; closed only at release because another
        # thread may still be inside pread() on them (closing could let the
        # number be reused for an unrelated file mid-read).
        self.stale_fds: list[int] = []


class _VolumeOps:
    """mfusepy operations (duck-typed: mfusepy only looks methods up by name).

    Not a subclass of mfusepy.Operations so this module imports without
    libfuse; mfusepy is imported only inside the server process.
    """

    use_ns = True  # utimens gets integer nanoseconds

    def __init__(
        self, backing: str, profile: VolumeProfile, on_init: Callable[[], None] | None = None
    ) -> None:
        self._root = os.path.realpath(backing)
        self._profile = profile
        self._on_init = on_init
        self._lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self._refused_handles: set[int] = set()  # opened with O_DIRECT under "read" refusal
        self._ids = itertools.count(1)
        self._rng = random.Random(profile.seed)
        self._fault_fired = [0] * len(profile.faults)
        self._mount_bucket = (
            _TokenBucket(profile.mount_bytes_per_s) if profile.mount_bytes_per_s else None
        )
        self._served: dict[str, int] = {}
        self._replace_done = [False] * len(profile.replace)
        self._replace_paths = {_norm_rel(r.path) for r in profile.replace}
        self._generation: dict[str, int] = {}
        self._replace_lock = threading.Lock()
        self._inflight = 0
        self._counters = _zero_stats()

    # -- helpers ----------------------------------------------------------

    def _full(self, path: str) -> str:
        return os.path.join(self._root, path.lstrip("/"))

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out["inflight_reads"] = self._inflight
            return out

    def reset_stats(self) -> None:
        with self._lock:
            self._counters = _zero_stats()
            self._counters["max_inflight_reads"] = self._inflight

    def _new_handle(self, fd: int, path: str, flags: int) -> int:
        rel = _norm_rel(path)
        rate = self._profile.per_stream_bytes_per_s
        with self._lock:
            fh = next(self._ids)
            self._handles[fh] = _Handle(
                fd,
                rel,
                flags,
                self._generation.get(rel, 0),
                _TokenBucket(rate) if rate else None,
            )
            self._counters["opens"] += 1
        return fh

    def _handle(self, fh: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:
            raise OSError(errno_mod.EBADF, os.strerror(errno_mod.EBADF))
        return h

    def _pick_fault(self, rel: str, offset: int, inflight: int) -> Fault | None:
        # Caller holds self._lock, so `limit` and the RNG stay consistent.
        for i, f in enumerate(self._profile.faults):
            if f.limit is not None and self._fault_fired[i] >= f.limit:
                continue
            if offset < f.after_bytes:
                continue
            if f.max_inflight is not None and inflight <= f.max_inflight:
                continue
            if not fnmatch.fnmatchcase(rel, f.path_glob):
                continue
            if f.rate < 1.0 and self._rng.random() >= f.rate:
                continue
            self._fault_fired[i] += 1
            self._counters["faults_injected"] += 1
            return f
        return None

    def _current_fd(self, h: _Handle) -> int:
        gen = self._generation.get(h.rel, 0)
        if gen == h.generation:
            return h.fd
        # The file was replaced under this handle: reopen by name so the
        # reader sees the new inode, as it would on a network volume that
        # does not pin the old object.
        with h.lock:
            if gen != h.generation:
                flags = h.flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)
                new_fd = os.open(self._full(h.rel), flags)
                h.stale_fds.append(h.fd)
                h.fd = new_fd
                h.generation = gen
            return h.fd

    def _account_served(self, rel: str, nbytes: int) -> None:
        if rel not in self._replace_paths:
            return
        with self._lock:
            total = self._served.get(rel, 0) + nbytes
            self._served[rel] = total
            due = [
                i
                for i, r in enumerate(self._profile.replace)
                if not self._replace_done[i] and _norm_rel(r.path) == rel and total >= r.after_bytes
            ]
            for i in due:
                self._replace_done[i] = True
        for i in due:
            try:
                self._do_replace(self._profile.replace[i])
            except OSError as e:
                # The bytes were already read: report on stderr (shown if
                # the test fails) rather than failing this read request.
                print(f"testvol: Replace {self._profile.replace[i]} failed: {e}", file=sys.stderr)

    def _do_replace(self, r: Replace) -> None:
        rel = _norm_rel(r.path)
        target = self._full(rel)
        with self._replace_lock:
            try:
                os.replace(r.with_file, target)
            except OSError as e:
                if e.errno != errno_mod.EXDEV:
                    raise
                # Different filesystem: stage a copy next to the target so the
                # final swap is still one atomic rename.
                fd, tmp = tempfile.mkstemp(prefix=".replace-", dir=os.path.dirname(target))
                os.close(fd)
                shutil.copy2(r.with_file, tmp)
                os.replace(tmp, target)
            with self._lock:
                self._generation[rel] = self._generation.get(rel, 0) + 1
                self._counters["replacements"] += 1

    # -- lifecycle --------------------------------------------------------

    def init_with_config(self, conn_info: Any, config: Any) -> None:
        if config is not None:
            # Zero timeouts: a replaced file's size/mtime/inode show at once.
            config.entry_timeout = 0.0
            config.negative_timeout = 0.0
            config.attr_timeout = 0.0
            config.use_ino = 1  # report the backing file's real st_ino
            config.hard_remove = 1
            config.readdir_ino = 1
            config.direct_io = 1  # bypass the page cache (see module doc)
            config.kernel_cache = 0
            config.auto_cache = 0
        if self._on_init is not None:
            self._on_init()

    def destroy(self, path: str) -> None:
        return None

    # -- metadata ---------------------------------------------------------

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        # By path first, so a replaced file shows its new inode/size/mtime
        # even through an old handle; an unlinked-but-open file (hard_remove
        # gives path None) falls back to the handle's own fd.
        try:
            if path is None:
                raise FileNotFoundError(errno_mod.ENOENT, "unlinked")
            st = os.lstat(self._full(path))
        except FileNotFoundError:
            h = self._handles.get(fh) if fh is not None else None
            if h is None:
                raise
            st = os.fstat(h.fd)
        return {
            "st_mode": st.st_mode,
            "st_ino": st.st_ino,
            "st_nlink": st.st_nlink,
            "st_uid": st.st_uid,
            "st_gid": st.st_gid,
            "st_rdev": st.st_rdev,
            "st_size": st.st_size,
            "st_blocks": st.st_blocks,
            "st_blksize": st.st_blksize,
            "st_atime": st.st_atime_ns,
            "st_mtime": st.st_mtime_ns,
            "st_ctime": st.st_ctime_ns,
        }

    def readdir(self, path: str, fh: int) -> list[Any]:
        entries: list[Any] = [".", ".."]
        with os.scandir(self._full(path)) as it:
            for e in it:
                try:
                    mode = e.stat(follow_symlinks=False).st_mode
                except FileNotFoundError:
                    continue  # removed while listing
                entries.append((e.name, {"st_mode": mode, "st_ino": e.inode()}, 0))
        return entries

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode, follow_symlinks=False):
            raise OSError(errno_mod.EACCES, os.strerror(errno_mod.EACCES))
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._full(path))

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._full(path))
        keys = (
            "f_bsize",
            "f_frsize",
            "f_blocks",
            "f_bfree",
            "f_bavail",
            "f_files",
            "f_ffree",
            "f_favail",
            "f_flag",
            "f_namemax",
        )
        return {k: int(getattr(sv, k)) for k in keys}

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.lchown(self._full(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        full = self._full(path)
        if times is None:
            os.utime(full, follow_symlinks=False)
            return 0
        st = os.lstat(full)
        now = time.time_ns()
        current = (st.st_atime_ns, st.st_mtime_ns)
        resolved = []
        for value, cur in zip(times, current, strict=True):
            # libfuse passes the sentinels with tv_sec = 0, so after mfusepy's
            # folding they arrive as exactly these small integers.
            if value == _UTIME_OMIT:
                resolved.append(cur)
            elif value == _UTIME_NOW:
                resolved.append(now)
            else:
                resolved.append(int(value))
        os.utime(full, ns=(resolved[0], resolved[1]), follow_symlinks=False)
        return 0

    # -- namespace --------------------------------------------------------

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._full(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._full(path))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._full(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._full(old), self._full(new))
        return 0

    def symlink(self, target: str, source: str) -> int:
        # mfusepy convention: create `target` (in the volume) pointing at `source`.
        os.symlink(source, self._full(target))
        return 0

    def link(self, target: str, source: str) -> int:
        os.link(self._full(source), self._full(target))
        return 0

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        if fh is not None and fh in self._handles:
            os.ftruncate(self._handle(fh).fd, length)
        else:
            os.truncate(self._full(path), length)
        return 0

    # -- file I/O ---------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        direct = bool(flags & getattr(os, "O_DIRECT", 0))
        refusal = self._profile.refuse_direct_io
        if direct and refusal == "open":
            raise OSError(errno_mod.EINVAL, os.strerror(errno_mod.EINVAL))
        flags = _backing_flags(flags)
        fd = os.open(self._full(path), flags)
        fh = self._new_handle(fd, path, flags)
        if direct and refusal == "read":
            with self._lock:
                self._refused_handles.add(fh)
        return fh

    def create(self, path: str, mode: int, flags: int) -> int:
        flags = _backing_flags(flags)
        fd = os.open(self._full(path), flags | os.O_CREAT, mode)
        return self._new_handle(fd, path, flags)

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        h = self._handle(fh)
        latency = self._profile.latency_s
        if fh in self._refused_handles:
            raise OSError(errno_mod.EINVAL, os.strerror(errno_mod.EINVAL))
        with self._lock:
            self._inflight += 1
            c = self._counters
            c["reads"] += 1
            c["max_inflight_reads"] = max(c["max_inflight_reads"], self._inflight)
            fault = self._pick_fault(h.rel, offset, self._inflight)
        try:
            if fault is not None:
                # A failed request still costs a round trip.
                if latency > 0:
                    time.sleep(latency)
                raise OSError(fault.errno, os.strerror(fault.errno))
            arrived = time.monotonic()
            data = os.pread(self._current_fd(h), size, offset)
            # A request is served no sooner than `latency` after it arrived and no
            # sooner than the buckets allow: the round trip overlaps the transfer, so
            # a sequential stream of large requests reaches its per-stream cap, as on
            # the volumes the defaults were measured on.
            deadline = arrived + latency
            if h.bucket is not None:
                deadline = max(deadline, h.bucket.reserve(len(data), arrived))
            if self._mount_bucket is not None:
                deadline = max(deadline, self._mount_bucket.reserve(len(data), arrived))
            # Sleep with no lock held so concurrent requests overlap.
            delay = deadline - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with self._lock:
                self._counters["bytes_read"] += len(data)
            self._account_served(h.rel, len(data))
            return data
        finally:
            with self._lock:
                self._inflight -= 1

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        h = self._handle(fh)
        n = os.pwrite(self._current_fd(h), data, offset)
        with self._lock:
            self._counters["writes"] += 1
            self._counters["bytes_written"] += n
        return n

    def flush(self, path: str | None, fh: int) -> int:
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        fd = self._handle(fh).fd
        if datasync:
            os.fdatasync(fd)
        else:
            os.fsync(fd)
        return 0

    def release(self, path: str | None, fh: int) -> int:
        with self._lock:
            h = self._handles.pop(fh, None)
            self._refused_handles.discard(fh)
        if h is not None:
            for fd in (h.fd, *h.stale_fds):
                os.close(fd)
        return 0


def _zero_stats() -> dict[str, int]:
    keys = (
        "reads",
        "bytes_read",
        "faults_injected",
        "max_inflight_reads",
        "opens",
        "writes",
        "bytes_written",
        "replacements",
    )
    return dict.fromkeys(keys, 0)


def _backing_flags(flags: int) -> int:
    # A client's O_DIRECT must not reach the backing file: our pread buffers
    # are not aligned (EINVAL) and tmpfs backings refuse O_DIRECT outright.
    # The mount itself is direct_io already, so the client still bypasses
    # the page cache.
    return flags & ~getattr(os, "O_DIRECT", 0)


def _norm_rel(path: str) -> str:
    rel = os.path.normpath(path.lstrip("/"))
    return "" if rel == "." else rel


def _control_loop(ops: _VolumeOps, ctl: IO[bytes], mountpoint: str) -> None:
    """Answer the parent's requests on stdin; one JSON line per request.

    EOF means the parent is gone (or done): unmount ourselves so a crashed
    test run never leaves a stale mount behind.
    """
    lock = threading.Lock()

    def reply(obj: object) -> None:
        with lock:
            ctl.write(json.dumps(obj).encode() + b"\n")
            ctl.flush()

    # Raw reads on fd 0: a daemon thread blocked inside sys.stdin's buffered
    # reader holds its lock and makes interpreter shutdown abort.
    buf = b""
    while True:
        while b"\n" not in buf:
            chunk = os.read(0, 4096)
            if not chunk:
                break
            buf += chunk
        if b"\n" not in buf:
            break
        line, _, buf = buf.partition(b"\n")
        cmd = line.strip().decode(errors="replace")
        if cmd == "stats":
            reply(ops.stats())
        elif cmd == "reset":
            ops.reset_stats()
            reply({"ok": True})
        elif cmd:
            reply({"error": f"unknown command {cmd!r}"})
    _fusermount(mountpoint, lazy=True)
    # If clients still hold files open, the lazily detached mount keeps the
    # FUSE loop alive; give it a moment, then abort the connection.
    time.sleep(0.5)
    os._exit(0)


def _serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loaderplug.testing.volume",
        description="Serve a backing folder as a slow, faulty FUSE volume.",
    )
    parser.add_argument("--backing", required=True)
    parser.add_argument("--mountpoint", required=True)
    parser.add_argument("--profile-json", default="{}")
    parser.add_argument("--max-threads", type=int, default=_FUSE_MAX_THREADS)
    args = parser.parse_args(argv)
    profile = VolumeProfile.from_json(args.profile_json)

    # Responses go to a private dup of stdout; fd 1 itself is pointed at
    # stderr so stray prints (libfuse, warnings) cannot corrupt the channel.
    ctl = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)

    # mfusepy loads libfuse2 unless told otherwise; only libfuse3 has the
    # max_threads knob this volume relies on.
    os.environ["FUSE_LIBRARY_NAME"] = "fuse3"
    import mfusepy

    if mfusepy.fuse_version_major != 3:
        print(f"loaded libfuse {mfusepy.fuse_version_major}, need 3", file=sys.stderr)
        return 2

    def on_init() -> None:
        ctl.write(b'{"ready": true}\n')
        ctl.flush()

    ops = _VolumeOps(args.backing, profile, on_init=on_init)
    threading.Thread(
        target=_control_loop,
        args=(ops, ctl, args.mountpoint),
        name="testvol-control",
        daemon=True,
    ).start()
    mfusepy.FUSE(
        ops,
        args.mountpoint,
        foreground=True,
        fsname=SUBTYPE,
        subtype=SUBTYPE,
        # Passed on the command line too (not only via init's config) so
        # libfuse's own attribute caching agrees from the first lookup.
        attr_timeout=0,
        entry_timeout=0,
        negative_timeout=0,
        use_ino=True,
        direct_io=True,
        # Unlink for real, even while open: libfuse's default renames such
        # files to .fuse_hidden* in the backing folder instead.
        hard_remove=True,
        max_threads=args.max_threads,
        max_idle_threads=args.max_threads,
    )
    return 0


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


@functools.cache
def fuse_unavailable_reason() -> str | None:
    """Why a test volume cannot be mounted here, or None if it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse does not exist (no FUSE kernel support in this sandbox)"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not on PATH (install the fuse3 package)"
    # Probe in a child: importing mfusepy here would load a libfuse into the
    # caller for good, and the library choice is fixed at import time.
    probe = (
        "import os; os.environ['FUSE_LIBRARY_NAME'] = 'fuse3'; import mfusepy; "
        "print(mfusepy.fuse_version_major)"
    )
    try:
        res = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not probe mfusepy: {e}"
    if res.returncode != 0:
        tail = res.stderr.strip().splitlines()[-1:] or ["(no output)"]
        return f"mfusepy does not import with libfuse3: {tail[0]}"
    if res.stdout.strip() != "3":
        return f"mfusepy loaded libfuse {res.stdout.strip()}, need 3"
    return None


def _unescape_mountinfo(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _mount_fstype(mountpoint: str) -> str | None:
    """The fstype of the topmost mount at `mountpoint`, or None if none."""
    found: str | None = None
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and _unescape_mountinfo(fields[4]) == mountpoint:
                found = right.split()[0] if right else "?"
    return found


def _fusermount(mountpoint: str, *, lazy: bool) -> bool:
    cmd = ["fusermount3", "-uz" if lazy else "-u", mountpoint]
    try:
        res = subprocess.run(cmd, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


def _unmount(mountpoint: str) -> None:
    if _mount_fstype(mountpoint) is None:
        return
    if _fusermount(mountpoint, lazy=False):
        return
    # Busy (a file is still open, a cwd is inside): detach it now; the
    # kernel finishes the unmount when the last user goes away.
    if _fusermount(mountpoint, lazy=True):
        return
    subprocess.run(["umount", "-l", mountpoint], capture_output=True, timeout=30, check=False)


class _ControlChannel:
    """Line-oriented request/response over the server's stdin/stdout."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self._proc = proc
        self._in = proc.stdin
        self._out_fd = proc.stdout.fileno()
        self._buf = b""
        self._lock = threading.Lock()

    def read_json(self, timeout_s: float) -> dict[str, Any] | None:
        """Next JSON line, or None on timeout/EOF."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._out_fd], [], [], min(left, 0.05))
            if not ready:
                continue
            chunk = os.read(self._out_fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise RuntimeError(f"test volume sent a non-object: {line!r}")
        return obj

    def request(self, cmd: str, timeout_s: float = 30.0) -> dict[str, Any]:
        with self._lock:
            try:
                self._in.write(cmd.encode() + b"\n")
                self._in.flush()
            except BrokenPipeError as e:
                raise RuntimeError("test volume server has exited") from e
            obj = self.read_json(timeout_s)
        if obj is None:
            raise RuntimeError(
                f"test volume server did not answer {cmd!r} (exit code {self._proc.poll()})"
            )
        return obj

    def close(self) -> None:
        with suppress(OSError):
            self._in.close()


class TestVolume:
    """A mounted test volume (yielded by `mounted`)."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(
        self,
        mountpoint: Path,
        backing: Path,
        profile: VolumeProfile,
        proc: subprocess.Popen[bytes],
        channel: _ControlChannel,
    ) -> None:
        self.mountpoint = mountpoint
        self.backing = backing
        self.profile = profile
        self._proc = proc
        self._channel = channel

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stats(self) -> dict[str, int]:
        """Server counters as of now.

        Keys: reads (read requests received, faulted ones included),
        bytes_read, faults_injected, max_inflight_reads (high-water mark),
        opens, inflight_reads, writes, bytes_written, replacements.
        """
        obj = self._channel.request("stats")
        return {str(k): int(v) for k, v in obj.items()}

    def reset_stats(self) -> None:
        """Zero the counters (max_inflight_reads restarts from current load)."""
        self._channel.request("reset")


def _stderr_tail(f: IO[bytes], limit: int = 4000) -> str:
    try:
        f.flush()
        f.seek(0)
        data = f.read()
    except (OSError, ValueError):
        return "(stderr unavailable)"
    text = data.decode(errors="replace").strip()
    return text[-limit:] if text else "(empty)"


def _stop_server(proc: subprocess.Popen[bytes], mountpoint: str) -> None:
    try:
        proc.wait(timeout=10)
        return
    except subprocess.TimeoutExpired:
        pass
    # A lazily detached mount with files still open keeps the loop running;
    # SIGTERM makes libfuse leave its loop, SIGKILL aborts the connection.
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        try:
            proc.send_signal(sig)
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return
    _unmount(mountpoint)


@contextmanager
def mounted(
    backing: Path,
    mountpoint: Path,
    profile: VolumeProfile = VolumeProfile(),  # frozen, so a shared default is safe
    *,
    timeout_s: float = 15.0,
) -> Iterator[TestVolume]:
    """Mount `backing` at `mountpoint` as a test volume for the `with` body."""
    backing = Path(backing)
    if not backing.is_dir():
        raise FileNotFoundError(f"backing folder does not exist: {backing}")
    mountpoint = Path(mountpoint)
    mountpoint.mkdir(parents=True, exist_ok=True)
    mp = os.path.realpath(mountpoint)
    stale = _mount_fstype(mp)
    if stale == FSTYPE:
        _unmount(mp)  # left over from a killed run of ours
    elif stale is not None:
        raise RuntimeError(f"{mp} is already a mount point ({stale})")

    pkg_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    env["FUSE_LIBRARY_NAME"] = "fuse3"
    cmd = [
        sys.executable,
        "-m",
        "loaderplug.testing.volume",
        "--backing",
        os.path.realpath(backing),
        "--mountpoint",
        mp,
        "--profile-json",
        profile.to_json(),
    ]
    with tempfile.TemporaryFile(prefix="testvol-stderr-") as err:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd="/",  # never hold the mountpoint busy
            env=env,
            # Own session: a Ctrl-C aimed at the test run must not kill the
            # server before the parent has unmounted.
            start_new_session=True,
        )
        channel = _ControlChannel(proc)
        try:
            ready = channel.read_json(timeout_s)
            if ready is None or not ready.get("ready") or _mount_fstype(mp) != FSTYPE:
                # EOF usually means the server died: reap it for the message.
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)
                state = (
                    f"server exited with code {proc.returncode}"
                    if proc.returncode is not None
                    else f"server still running after {timeout_s}s"
                )
                raise RuntimeError(
                    f"test volume did not come up at {mp} ({state}, "
                    f"mount type {_mount_fstype(mp)}, wanted {FSTYPE}); "
                    f"server stderr:\n{_stderr_tail(err)}"
                )
            yield TestVolume(mountpoint, backing, profile, proc, channel)
        finally:
            _unmount(mp)
            channel.close()
            _stop_server(proc, mp)
            if proc.stdout is not None:
                proc.stdout.close()


if __name__ == "__main__":
    _code = _serve()
    # Skip interpreter teardown: the control thread may still be blocked in
    # read(0), and nothing here needs finalizers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
