"""One rank of a shared load, for tests: joins a gloo group, loads, reports as JSON.

Usage: python rank_load.py INIT_FILE RANK WORLD FILE...

Environment: RANK_LOCAL_DIR (a one pass into it), RANK_FAIL (this rank's reads of files
whose name contains it fail with EACCES), RANK_DIE_AFTER (this rank dies after that many
tensors), RANK_DIE_AT_S (this rank kills itself with SIGKILL that many seconds into the
load, whatever it is doing, saying "dying at <unix time>" on stderr first),
RANK_CONSUMER_SLEEP_S (the consumer sleeps that long over the first tensor),
RANK_TENSOR_SLEEP_S (and that long over every tensor), RANK_DATA_DELAY_S (this rank's
reads of tensors' bytes, 64 KiB or more, land that long after the first is asked for;
headers are read at once), RANK_MAP_FAIL (this rank cannot
map the other ranks' files: ENOMEM, as when the address space runs out), RANK_DEVICE
(load to that device: a tensor off the CPU is recorded by its device, not its bytes),
RANK_FAKE_DEVICE=1 (CUDA devices are the stand-in of loaderplug.testing.fake_device,
whose memory is the host's: its tensors are recorded by their bytes), RANK_GROUP=none (no group
passed: the default group is found), RANK_VOLUME (what "{volume}" in a FILE stands for:
this rank's mount of the mirror), RANK_FILES (this rank's files instead of FILE...,
joined by os.pathsep: ranks passing the same files in another order, or other files),
RANK_REPLACE ("N:PATH:NEW": once this rank took N tensors, NEW is renamed over PATH,
as a download lands a new version), RANK_STOP_AFTER (this rank's consumer closes the
load after that many tensors, as a caller that stops early), and every LOADERPLUG_*
setting. INIT_FILE "env" joins by torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
...), RANK and WORLD ignored. Prints {"tensors":
{name: [dtype, shape, crc32]}, "reads": {file: bytes read through the source hook},
"read_paths": the same by path, "hosts": what the hosts did (split, why, bytes read
from this host's mirror and received), "error": message or null, "seconds": s, "first_tensor_s":
the load's, "failed_at": unix time of the error, "owners": which rank read each file,
"rss_growth": peak resident bytes over those before the load}.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import resource
import signal
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loaderplug import hookimpl
from loaderplug.errors import LoaderplugError
from loaderplug.plugins import manager as plugins
from loaderplug.storage.source import PosixSource
from loaderplug.tensors.reader import iter_tensors
from loaderplug.testing.fake_device import FakeDevice, FakeDevicePlugin
from loaderplug.types import IOPolicy

reads: dict[str, int] = {}  # by file name
read_paths: dict[str, int] = {}  # by path: the mirror's file or the local copy
lock = threading.Lock()
FAIL = os.environ.get("RANK_FAIL", "")
DATA_DELAY_S = float(os.environ.get("RANK_DATA_DELAY_S", "0"))
data_from: list[float] = []  # when this rank's reads of tensors' bytes may land


class CountingSource(PosixSource):
    def pread_into(self, buf: memoryview, offset: int) -> int:
        if FAIL and FAIL in Path(self.path).name:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), self.path)
        if DATA_DELAY_S and len(buf) >= 64 * 1024:
            with lock:
                if not data_from:
                    data_from.append(time.monotonic() + DATA_DELAY_S)
            time.sleep(max(0.0, data_from[0] - time.monotonic()))
        got = super().pread_into(buf, offset)
        with lock:
            reads[Path(self.path).name] = reads.get(Path(self.path).name, 0) + got
            read_paths[self.path] = read_paths.get(self.path, 0) + got
        return got


class Count:
    @hookimpl
    def loaderplug_open_source(self, path: str, policy: IOPolicy) -> PosixSource:
        return CountingSource(path, policy)


def die() -> None:
    print(f"dying at {time.time()}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    init, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    # "{volume}" in a file's path is this rank's mount of the mirror (RANK_VOLUME).
    given = (
        os.environ["RANK_FILES"].split(os.pathsep) if "RANK_FILES" in os.environ else sys.argv[4:]
    )
    files = [f.replace("{volume}", os.environ.get("RANK_VOLUME", "")) for f in given]
    dist.init_process_group(
        "gloo",
        # "env": torchrun's variables (simulated hosts), rank and world from them.
        init_method="env://" if init == "env" else f"file://{init}",
        rank=int(os.environ["RANK"]) if init == "env" else rank,
        world_size=int(os.environ["WORLD_SIZE"]) if init == "env" else world,
        timeout=datetime.timedelta(seconds=60),
    )
    plugins.register(Count())
    if os.environ.get("RANK_FAKE_DEVICE"):
        plugins.register(FakeDevicePlugin(FakeDevice()))
    die_at = float(os.environ.get("RANK_DIE_AT_S", "0"))
    if die_at:
        threading.Timer(die_at, die).start()
    if os.environ.get("RANK_MAP_FAIL"):
        from loaderplug.tensors.ranks import pagecache as rank_pagecache
        from loaderplug.tensors.ranks import stream as rank_stream

        def refuse(*args: object) -> None:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

        rank_stream.MappedFiles._map = refuse  # type: ignore[assignment,method-assign]
        rank_pagecache.MappedTensors = refuse  # type: ignore[assignment,misc]
    group = None if os.environ.get("RANK_GROUP") == "none" else dist.group.WORLD
    out: dict[str, object] = {"tensors": {}, "error": None}
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch, the group
    started = time.monotonic()
    device = os.environ.get("RANK_DEVICE", "cpu")
    local_dir = os.environ.get("RANK_LOCAL_DIR") or None
    load = iter_tensors(files, device, local_dir=local_dir, group=group)
    try:
        consume(load, out["tensors"])  # type: ignore[arg-type]
    except LoaderplugError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["failed_at"] = time.time()
    out["seconds"] = time.monotonic() - started
    out.update(figures(load))
    out["rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    print(json.dumps(out))
    return 0


def consume(load: Any, tensors: dict[str, object]) -> None:
    """Take every tensor, recording it, as the environment says (dying, sleeping,
    replacing a file on the way)."""
    die_after = int(os.environ.get("RANK_DIE_AFTER", "0"))
    consumer_sleep = float(os.environ.get("RANK_CONSUMER_SLEEP_S", "0"))
    tensor_sleep = float(os.environ.get("RANK_TENSOR_SLEEP_S", "0"))
    replace = os.environ["RANK_REPLACE"].split(":") if os.environ.get("RANK_REPLACE") else None
    stop_after = int(os.environ.get("RANK_STOP_AFTER", "0"))
    for n, (name, tensor) in enumerate(load, start=1):
        if stop_after and n > stop_after:
            load.close()
            return
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.device.type == "cpu":
            raw = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            tensors[name] = [dtype, list(tensor.shape), zlib.crc32(raw)]
        else:
            tensors[name] = [dtype, list(tensor.shape), tensor.device.type]
        if die_after and n >= die_after:
            os._exit(9)
        if replace and n == int(replace[0]):
            os.replace(replace[2], replace[1])
        if consumer_sleep and n == 1:
            time.sleep(consumer_sleep)
        time.sleep(tensor_sleep)


def figures(load: Any) -> dict[str, object]:
    """What the load says it did, for the test to read."""
    out: dict[str, object] = {"reads": reads, "read_paths": read_paths}
    out["sharing"] = load.sharing
    out["owners"] = load.owners
    if load.hosts is not None:
        done = load.hosts.exchanged
        out["hosts"] = {
            "hosts": load.hosts.hosts,
            "split": load.hosts.split,
            "why": load.hosts.why,
            "mirror_bytes": done.mirror_bytes if done else None,
            "received_bytes": done.received_bytes if done else None,
            "disk_bytes": done.disk_bytes if done else None,
        }
    out["first_tensor_s"] = load.first_tensor_s
    out["bytes_in_flight"] = load.bytes_in_flight
    out["host_copied_bytes"] = load.host_copied_bytes
    out["device_copied_bytes"] = load.device_copied_bytes
    return out


if __name__ == "__main__":
    sys.exit(main())
