"""The test volume's fault model: how slow and how faulty it is, and the pure logic behind it.

`VolumeProfile` (with its `Fault` and `Replace` entries) is shared by the parent and
the FUSE server and crosses the process boundary as JSON. `TokenBucket`, `FaultPicker`
and `ReplaceSchedule` are what the server (`loaderplug.testing.fuse_server`) applies
to each request (a fault to the operations it names: reads by default, and writes,
opens and metadata such as a file's attributes or times); they do no I/O, so they can
be tested without FUSE.
"""

from __future__ import annotations

import dataclasses
import errno as errno_mod
import fnmatch
import json
import os
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from loaderplug.units import MiB

__all__ = [
    "FAULT_OPS",
    "Fault",
    "FaultPicker",
    "Replace",
    "ReplaceSchedule",
    "TokenBucket",
    "VolumeProfile",
    "norm_rel",
]


# The FUSE operations a fault can fail, by their names in the server: a file's content
# (read, write, fsync), opening it (open, create), its attributes (getattr: every stat,
# and the lookup of a path the kernel does not know yet), its times (utimens: a touch)
# and changes of names (rename, unlink).
FAULT_OPS = ("read", "write", "fsync", "open", "create", "getattr", "utimens", "rename", "unlink")


@dataclass(frozen=True)
class Fault:
    """An injected error, for the FUSE requests of the operations ``ops`` (reads by
    default) on paths that match ``path_glob``.

    Evaluated once per such request; the first fault that matches and fires wins.
    ``after_bytes`` spares requests at lower offsets (a read or write; any other request
    is at offset 0), ``max_inflight`` those made while no more than that many read
    requests are in flight, and ``limit`` stops the fault after that many.
    """

    errno: int
    rate: float = 1.0
    path_glob: str = "*"
    max_inflight: int | None = None
    after_bytes: int = 0
    limit: int | None = None
    ops: tuple[str, ...] = ("read",)

    def __post_init__(self) -> None:
        # A list from JSON or from hand-written code, kept as a tuple: hashable, immutable.
        object.__setattr__(self, "ops", tuple(self.ops))
        unknown = sorted(set(self.ops) - set(FAULT_OPS))
        if unknown or not self.ops:
            raise ValueError(f"Fault.ops must be some of {FAULT_OPS}, got {self.ops}")
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


INODE_NUMBERS = ("stable", "node-ids", "new-each-look")


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
    # Which inode numbers the mount reports: "stable" (the backing file's), "node-ids"
    # (libfuse's node ids, as a FUSE filesystem without inode numbers of its own
    # reports: a file gets a new one each time the kernel forgets its inode, which
    # memory pressure does), "new-each-look" (a new one in every attribute answer).
    inode_numbers: str = "stable"
    # NFS's stale file handles: this share of reads finds its handle stale, and that
    # read and every later one of the handle fail with ESTALE; opening the path again
    # gives a good handle. With it on, a handle opened before its file was replaced
    # is stale too (NFS), instead of reading the new file (an object store's way).
    stale_handles: float = 0.0
    # Modification times in whole seconds, as some FUSE filesystems report them.
    whole_second_mtimes: bool = False
    # NFS's attribute cache (actimeo): a path's attributes are answered from a cache
    # up to this old, so a file replaced behind the mount's back keeps showing the
    # old size, mtime and inode for a while. Opening the path refreshes them
    # (close-to-open consistency), and the mount's own changes are seen at once.
    attr_lag_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_stream_bytes_per_s", "mount_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        if self.latency_s < 0:
            raise ValueError("latency_s must be >= 0")
        if self.inode_numbers not in INODE_NUMBERS:
            raise ValueError(f"inode_numbers must be one of {INODE_NUMBERS}")
        if not 0.0 <= self.stale_handles <= 1.0:
            raise ValueError(f"stale_handles must be in [0, 1], got {self.stale_handles}")
        if self.attr_lag_s < 0:
            raise ValueError("attr_lag_s must be >= 0")
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


class TokenBucket:
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


class FaultPicker:
    """Which `Fault`, if any, a request gets.

    Not thread-safe: the caller serialises `pick` (the server holds its lock), so
    `limit` and the RNG stay consistent.
    """

    def __init__(self, faults: Sequence[Fault], seed: int = 0) -> None:
        self._faults = tuple(faults)
        self._rng = random.Random(seed)
        self._fired = [0] * len(self._faults)
        # The operations some fault targets: the server asks about no other, so a fault
        # on a file's times costs its reads nothing.
        self.ops = frozenset(op for f in self._faults for op in f.ops)

    def pick(self, rel: str, offset: int, inflight: int, op: str = "read") -> Fault | None:
        """The first fault that matches an ``op`` request (see `FAULT_OPS`) of `rel` at
        `offset` and fires, or None.

        `inflight` counts the read requests in flight, this one included if a read.
        """
        for i, f in enumerate(self._faults):
            if op not in f.ops:
                continue
            if f.limit is not None and self._fired[i] >= f.limit:
                continue
            if offset < f.after_bytes:
                continue
            if f.max_inflight is not None and inflight <= f.max_inflight:
                continue
            if not fnmatch.fnmatchcase(rel, f.path_glob):
                continue
            if f.rate < 1.0 and self._rng.random() >= f.rate:
                continue
            self._fired[i] += 1
            return f
        return None


class ReplaceSchedule:
    """Which `Replace` swaps are due, from the bytes served of each path.

    Not thread-safe: the caller serialises `served` (the server holds its lock)
    and does the swaps it returns itself.
    """

    def __init__(self, replace: Sequence[Replace]) -> None:
        self._replace = tuple(replace)
        self._done = [False] * len(self._replace)
        self._served: dict[str, int] = {}
        # Paths (as `norm_rel` gives them) that any swap watches.
        self.paths = frozenset(norm_rel(r.path) for r in self._replace)

    def served(self, rel: str, nbytes: int) -> list[Replace]:
        """Count `nbytes` more served from `rel`; the swaps now due, each returned once."""
        total = self._served.get(rel, 0) + nbytes
        self._served[rel] = total
        due = [
            i
            for i, r in enumerate(self._replace)
            if not self._done[i] and norm_rel(r.path) == rel and total >= r.after_bytes
        ]
        for i in due:
            self._done[i] = True
        return [self._replace[i] for i in due]


def norm_rel(path: str) -> str:
    """A volume path (``/a/b``, ``a//b``, ``a/./b``) as a relative one (``a/b``); ``""`` is
    the root."""
    rel = os.path.normpath(path.lstrip("/"))
    return "" if rel == "." else rel
