"""A FUSE test volume: serves a backing folder as a slow, faulty network volume.

The volume is a read-write passthrough of a backing folder whose *reads* are
throttled (per open handle and per mount token buckets, with a minimum service time per
request), whose requests can fail with injected errnos (`Fault`: reads by default;
writes, opens, a file's attributes or times, renames and unlinks where a fault names
them), and which can have a file swapped underneath a reader (`Replace`). It is meant
for tests, benchmarks and demos of code that copies model files from a network-volume
mirror.

The FUSE server runs in its own process (``python -m loaderplug.testing.fuse_server``)
so its Python request handlers never compete for the GIL of the process under
test. `mounted` starts it, waits until the mount is live, and always unmounts.
This module is that parent side; the profile and its fault model live in
`loaderplug.testing.faults`, the server in `loaderplug.testing.fuse_server`.

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
* At most ``fuse_server._FUSE_MAX_THREADS`` (64) requests are served at once
  (libfuse 3's default of 10 is raised via ``-o max_threads``); more wait in the
  kernel.
* Unlinks are real (``hard_remove``): no ``.fuse_hidden*`` files appear in the
  backing folder, but ``fstat`` on an open-then-unlinked file fails with
  ESTALE (reads and writes on it keep working).
* A client's ``O_DIRECT`` is honoured by the mount (it is direct_io anyway)
  but stripped when opening the backing file.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Any

from loaderplug.storage.mounts import read_mounts
from loaderplug.testing.faults import Fault, Replace, VolumeProfile
from loaderplug.testing.fuse_server import FSTYPE, fusermount

__all__ = [
    "FSTYPE",
    "Fault",
    "Replace",
    "TestVolume",
    "VolumeProfile",
    "fuse_unavailable_reason",
    "mounted",
]


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


def _mount_fstype(mountpoint: str) -> str | None:
    """The fstype of the topmost mount at `mountpoint`, or None if none."""
    # Exactly at `mountpoint`, not fs.find_mount's "mount that serves it": with nothing
    # mounted here that would be the enclosing mount, and its realpath() stats the mount
    # point, which a dead server answers with ENOTCONN and a wedged one never answers.
    found: str | None = None
    for mount in read_mounts():
        if mount.mount_point == mountpoint:
            found = mount.fs_type  # later entries stack on earlier ones
    return found


def _unmount(mountpoint: str) -> None:
    if _mount_fstype(mountpoint) is None:
        return
    if fusermount(mountpoint, lazy=False):
        return
    # Busy (a file is still open, a cwd is inside): detach it now; the
    # kernel finishes the unmount when the last user goes away.
    if fusermount(mountpoint, lazy=True):
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
        bytes_read, faults_injected (requests failed by a `Fault`, of every
        operation), max_inflight_reads (high-water mark),
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


def _start_server(
    backing: Path, mp: str, profile: VolumeProfile, err: IO[bytes]
) -> subprocess.Popen[bytes]:
    """Start the FUSE server process for ``backing`` at ``mp``; its stderr goes to ``err``."""
    pkg_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    env["FUSE_LIBRARY_NAME"] = "fuse3"
    cmd = [
        sys.executable,
        "-m",
        "loaderplug.testing.fuse_server",
        "--backing",
        os.path.realpath(backing),
        "--mountpoint",
        mp,
        "--profile-json",
        profile.to_json(),
    ]
    return subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        cwd="/",  # never hold the mountpoint busy
        env=env,
        # Own session: a Ctrl-C aimed at the test run must not kill the server before
        # the parent has unmounted.
        start_new_session=True,
    )


@contextmanager
def mounted(
    backing: Path,
    mountpoint: Path,
    profile: VolumeProfile = VolumeProfile(),  # noqa: B008 - frozen, so a shared default is safe
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

    with tempfile.TemporaryFile(prefix="testvol-stderr-") as err:
        proc = _start_server(backing, mp, profile, err)
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
