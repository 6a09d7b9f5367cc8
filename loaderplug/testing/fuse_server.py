"""The test volume's FUSE server: a throttled, faulty passthrough of a backing folder.

It runs in its own process, ``python -m loaderplug.testing.fuse_server``, started by
`loaderplug.testing.volume.mounted`, so its Python request handlers never compete for
the GIL of the process under test. It serves FUSE requests with `_VolumeOps`, applying
the `VolumeProfile` given as JSON on the command line (see `loaderplug.testing.faults`),
and answers the parent's control requests on stdin/stdout, one JSON line each:
``stats`` (the counters), ``reset`` (zero them). EOF on stdin makes it unmount itself.
What a client of the mount sees is described in `loaderplug.testing.volume`.

Keep the imports light: this module is imported by the parent too, and mfusepy (which
loads libfuse for good) is imported only inside the server process, by `_serve`.
"""

from __future__ import annotations

import argparse
import errno as errno_mod
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

from loaderplug.testing.faults import (
    FaultPicker,
    Replace,
    ReplaceSchedule,
    TokenBucket,
    VolumeProfile,
    norm_rel,
)

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


class _Handle:
    __slots__ = ("bucket", "fd", "flags", "generation", "lock", "rel", "stale", "stale_fds")

    def __init__(
        self, fd: int, rel: str, flags: int, generation: int, bucket: TokenBucket | None
    ) -> None:
        self.fd = fd
        self.rel = rel
        self.flags = flags
        self.generation = generation
        self.bucket = bucket
        self.lock = threading.Lock()
        self.stale = False  # VolumeProfile.stale_handles: every read fails with ESTALE
        # fds replaced by a reopen; closed only at release because another
        # thread may still be inside pread() on them (closing could let the
        # number be reused for an unrelated file mid-read).
        self.stale_fds: list[int] = []


class _NamespaceOps:
    """The namespace half of the volume's operations: attributes (with the habits of
    network filesystems: inode numbers, coarse mtimes, an attribute cache) and changes
    to names. :class:`_VolumeOps` adds open files and their IO."""

    _root: str
    _profile: VolumeProfile
    _inode_numbers: Iterator[int]
    _attrs: dict[str, tuple[float, dict[str, Any]]]
    _lock: threading.Lock
    _handles: dict[int, _Handle]
    _faults: FaultPicker
    _inflight: int
    _counters: dict[str, int]

    def _handle(self, fh: int) -> _Handle:
        h = self._handles.get(fh)
        if h is None:
            raise OSError(errno_mod.EBADF, os.strerror(errno_mod.EBADF))
        return h

    def _full(self, path: str) -> str:
        return os.path.join(self._root, path.lstrip("/"))

    @property
    def _own_inode_numbers(self) -> bool:
        return self._profile.inode_numbers != "node-ids"

    def _fail_if_faulted(self, op: str, path: str, offset: int = 0) -> None:
        """Fail an ``op`` request (see `FAULT_OPS`) of ``path`` as the first fault that
        matches and fires says, if one does. Reads draw theirs in `_VolumeOps.read`,
        which counts them in flight first."""
        if op not in self._faults.ops:
            return
        with self._lock:  # FaultPicker and its RNG are not thread-safe
            fault = self._faults.pick(norm_rel(path), offset, self._inflight, op)
            if fault is not None:
                self._counters["faults_injected"] += 1
        if fault is not None:
            raise OSError(fault.errno, os.strerror(fault.errno))

    # -- metadata ---------------------------------------------------------

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        # An unlinked file still open has no path: its handle's is the one it had.
        handle = self._handles.get(fh) if fh is not None else None
        named = path if path is not None else handle.rel if handle is not None else None
        if named is not None:
            self._fail_if_faulted("getattr", named)
        lag = self._profile.attr_lag_s
        if lag and path is not None:
            rel = norm_rel(path)
            with self._lock:
                cached = self._attrs.get(rel)
            if cached is not None and time.monotonic() - cached[0] < lag:
                return cached[1]
        attrs = self._fresh_attrs(path, fh)
        if lag and path is not None:
            with self._lock:
                self._attrs[norm_rel(path)] = (time.monotonic(), attrs)
        return attrs

    def _fresh_attrs(self, path: str | None, fh: int | None) -> dict[str, Any]:
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
        times = [st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns]
        if self._profile.whole_second_mtimes:
            times = [t - t % 1_000_000_000 for t in times]
        renumber = self._profile.inode_numbers == "new-each-look"
        return {
            "st_mode": st.st_mode,
            "st_ino": next(self._inode_numbers) if renumber else st.st_ino,
            "st_nlink": st.st_nlink,
            "st_uid": st.st_uid,
            "st_gid": st.st_gid,
            "st_rdev": st.st_rdev,
            "st_size": st.st_size,
            "st_blocks": st.st_blocks,
            "st_blksize": st.st_blksize,
            "st_atime": times[0],
            "st_mtime": times[1],
            "st_ctime": times[2],
        }

    def _changed_here(self, *paths: str) -> None:
        """Forget the cached attributes of paths the mount itself changed: a client sees
        its own changes at once, even with an attribute cache (``attr_lag_s``)."""
        if self._profile.attr_lag_s:
            with self._lock:
                for path in paths:
                    self._attrs.pop(norm_rel(path), None)

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
        self._changed_here(path)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.lchown(self._full(path), uid, gid)
        self._changed_here(path)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self._fail_if_faulted("utimens", path)
        full = self._full(path)
        if times is None:
            os.utime(full, follow_symlinks=False)
            self._changed_here(path)
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
        self._changed_here(path)
        return 0

    # -- namespace --------------------------------------------------------

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._full(path), mode)
        self._changed_here(path)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._full(path))
        self._changed_here(path)
        return 0

    def unlink(self, path: str) -> int:
        self._fail_if_faulted("unlink", path)
        os.unlink(self._full(path))
        self._changed_here(path)
        return 0

    def rename(self, old: str, new: str) -> int:
        # A fault on either name: a file renamed away, or another renamed over it.
        self._fail_if_faulted("rename", old)
        self._fail_if_faulted("rename", new)
        os.rename(self._full(old), self._full(new))
        self._changed_here(old, new)
        return 0

    def symlink(self, target: str, source: str) -> int:
        # mfusepy convention: create `target` (in the volume) pointing at `source`.
        os.symlink(source, self._full(target))
        self._changed_here(target)
        return 0

    def link(self, target: str, source: str) -> int:
        os.link(self._full(source), self._full(target))
        self._changed_here(target)
        return 0

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        if fh is not None and fh in self._handles:
            os.ftruncate(self._handle(fh).fd, length)
        else:
            os.truncate(self._full(path), length)
        self._changed_here(path)
        return 0

    # -- file I/O ---------------------------------------------------------


class _VolumeOps(_NamespaceOps):
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
        self._inode_numbers = itertools.count(1 << 40)  # "new-each-look": never a real one
        self._stale_rng = random.Random(profile.seed)
        # attr_lag_s: each path's last attribute answer and when it was taken.
        self._attrs: dict[str, tuple[float, dict[str, Any]]] = {}
        self._on_init = on_init
        self._lock = threading.Lock()
        self._handles: dict[int, _Handle] = {}
        self._refused_handles: set[int] = set()  # opened with O_DIRECT under "read" refusal
        self._ids = itertools.count(1)
        self._faults = FaultPicker(profile.faults, profile.seed)
        self._mount_bucket = (
            TokenBucket(profile.mount_bytes_per_s) if profile.mount_bytes_per_s else None
        )
        self._replaces = ReplaceSchedule(profile.replace)
        self._generation: dict[str, int] = {}
        self._replace_lock = threading.Lock()
        self._inflight = 0
        self._counters = _zero_stats()

    # -- helpers ----------------------------------------------------------

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
        rel = norm_rel(path)
        rate = self._profile.per_stream_bytes_per_s
        with self._lock:
            fh = next(self._ids)
            self._handles[fh] = _Handle(
                fd,
                rel,
                flags,
                self._generation.get(rel, 0),
                TokenBucket(rate) if rate else None,
            )
            self._counters["opens"] += 1
        return fh

    def _current_fd(self, h: _Handle) -> int:
        gen = self._generation.get(h.rel, 0)
        if gen == h.generation:
            return h.fd
        if self._profile.stale_handles:
            # NFS: the handle names the file that was replaced, which is gone.
            h.stale = True
            raise OSError(errno_mod.ESTALE, os.strerror(errno_mod.ESTALE))
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
        if rel not in self._replaces.paths:
            return
        with self._lock:
            due = self._replaces.served(rel, nbytes)
        for r in due:
            try:
                self._do_replace(r)
            except OSError as e:
                # The bytes were already read: report on stderr (shown if
                # the test fails) rather than failing this read request.
                print(f"testvol: Replace {r} failed: {e}", file=sys.stderr)

    def _do_replace(self, r: Replace) -> None:
        rel = norm_rel(r.path)
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
            # Report our st_ino, or leave libfuse's node ids ("node-ids").
            config.use_ino = int(self._own_inode_numbers)
            config.hard_remove = 1
            config.readdir_ino = int(self._own_inode_numbers)
            config.direct_io = 1  # bypass the page cache (see loaderplug.testing.volume)
            config.kernel_cache = 0
            config.auto_cache = 0
        if self._on_init is not None:
            self._on_init()

    def destroy(self, path: str) -> None:
        return None

    def open(self, path: str, flags: int) -> int:
        self._fail_if_faulted("open", path)
        direct = bool(flags & getattr(os, "O_DIRECT", 0))
        refusal = self._profile.refuse_direct_io
        if direct and refusal == "open":
            raise OSError(errno_mod.EINVAL, os.strerror(errno_mod.EINVAL))
        flags = _backing_flags(flags)
        fd = os.open(self._full(path), flags)
        self._changed_here(path)  # close-to-open: an open sees the file as it is now
        fh = self._new_handle(fd, path, flags)
        if direct and refusal == "read":
            with self._lock:
                self._refused_handles.add(fh)
        return fh

    def create(self, path: str, mode: int, flags: int) -> int:
        self._fail_if_faulted("create", path)
        flags = _backing_flags(flags)
        fd = os.open(self._full(path), flags | os.O_CREAT, mode)
        self._changed_here(path)
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
            # Picked under self._lock: FaultPicker and the RNG are not thread-safe.
            fault = self._faults.pick(h.rel, offset, self._inflight)
            if fault is not None:
                c["faults_injected"] += 1
            rate = self._profile.stale_handles
            if not h.stale and rate and self._stale_rng.random() < rate:
                h.stale = True
                c["stale_handles"] += 1
        try:
            if h.stale:
                raise OSError(errno_mod.ESTALE, os.strerror(errno_mod.ESTALE))
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
        self._fail_if_faulted("write", h.rel, offset)
        n = os.pwrite(self._current_fd(h), data, offset)
        self._changed_here(h.rel)
        with self._lock:
            self._counters["writes"] += 1
            self._counters["bytes_written"] += n
        return n

    def flush(self, path: str | None, fh: int) -> int:
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        h = self._handle(fh)
        self._fail_if_faulted("fsync", h.rel)
        fd = h.fd
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
        "stale_handles",
    )
    return dict.fromkeys(keys, 0)


def _backing_flags(flags: int) -> int:
    # A client's O_DIRECT must not reach the backing file: our pread buffers
    # are not aligned (EINVAL) and tmpfs backings refuse O_DIRECT outright.
    # The mount itself is direct_io already, so the client still bypasses
    # the page cache.
    return flags & ~getattr(os, "O_DIRECT", 0)


def fusermount(mountpoint: str, *, lazy: bool) -> bool:
    """Unmount with fusermount3 (``-uz`` if `lazy`); True if it succeeded.

    Used by the server on EOF and by the parent's cleanup.
    """
    cmd = ["fusermount3", "-uz" if lazy else "-u", mountpoint]
    try:
        res = subprocess.run(cmd, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0


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
    fusermount(mountpoint, lazy=True)
    # If clients still hold files open, the lazily detached mount keeps the
    # FUSE loop alive; give it a moment, then abort the connection.
    time.sleep(0.5)
    os._exit(0)


def _serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loaderplug.testing.fuse_server",
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
        use_ino=ops._own_inode_numbers,
        direct_io=True,
        # Unlink for real, even while open: libfuse's default renames such
        # files to .fuse_hidden* in the backing folder instead.
        hard_remove=True,
        max_threads=args.max_threads,
        max_idle_threads=args.max_threads,
    )
    return 0


if __name__ == "__main__":
    _code = _serve()
    # Skip interpreter teardown: the control thread may still be blocked in
    # read(0), and nothing here needs finalizers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
