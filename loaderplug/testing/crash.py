"""kill -9 at random points of a copy, then the checks a user would make.

Shared by tests/test_crash.py (a few trials each, in CI) and benchmarks/crash_bench.py
(twenty). A trial starts a ``loaderplug`` command with every read slowed down, kills it
with SIGKILL after a random delay, and checks what the kill left: every file published
at the destination is byte-identical to that file in one generation of the source (the
current or an older one), or absent. Then it runs the command again, normally: it must
complete, the destination must equal the source, and nothing of loaderplug's may be
left behind (temp files, partial copies, journals, a sync's mark).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from loaderplug.jobs.copies import hydrate
from loaderplug.jobs.file_sink import is_temp_name
from loaderplug.jobs.model_folder import SYNC_MARK_NAME as MARK_NAME
from loaderplug.jobs.model_folder import is_own_name
from loaderplug.plugins import manager as plugins
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.storage.source import PosixSource
from loaderplug.testing import slowed
from loaderplug.types import IOPolicy

ENV = {
    "LOADERPLUG_SPAN_BYTES": "64K",
    "LOADERPLUG_SPLIT_THRESHOLD_BYTES": "128K",
    "LOADERPLUG_READERS": "4",
    "LOADERPLUG_SYNC_STALE_S": "2",
}


def files_of(root: Path) -> dict[str, bytes]:
    """Every published file under ``root`` (loaderplug's own excluded), by path."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and not is_own_name(p.name)
    }


def leftovers(root: Path) -> list[Path]:
    """What loaderplug leaves only while it runs: temp files, partial copies and their
    journals, and a sync's mark."""
    if not root.exists():
        return []
    found = [p for p in root.rglob(".*") if is_temp_name(p.name)]
    return found + [p for p in root.rglob(MARK_NAME)]


@dataclass
class Trial:
    killed_after_s: float
    finished_first: bool  # the command was done before the kill came
    published_ok: bool  # every published file was whole, of one generation
    rerun_ok: bool  # the rerun completed, the copy equals the source, nothing left
    detail: str = ""


def run(args: list[str], delay_s: float = 0.0) -> subprocess.Popen[str]:
    return slowed.start(args, delay_s, ENV)


def kill_trial(
    args: list[str],
    source: Path,
    destination: Path,
    generations: list[dict[str, bytes]],
    rng: random.Random,
    *,
    most_s: float = 1.5,
    delay_s: float = 0.02,
) -> Trial:
    """Kill ``loaderplug ARGS`` (which copies ``source`` to ``destination``) after a random
    delay, check what it left against ``generations`` (what each file may be), rerun."""
    wait = rng.uniform(0.05, most_s)
    proc = run(args, delay_s)
    time.sleep(wait)
    finished = proc.poll() is not None
    if not finished:
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    published = files_of(destination)
    bad = [
        rel
        for rel, data in published.items()
        if not any(generation.get(rel) == data for generation in generations)
    ]
    rerun = run(args)
    _out, err = rerun.communicate(timeout=300)
    left = leftovers(destination)
    same = files_of(destination) == files_of(source)
    detail = "; ".join(
        filter(
            None,
            [
                f"published incomplete or mixed: {bad}" if bad else "",
                f"rerun exited {rerun.returncode}: {err[-500:]}" if rerun.returncode else "",
                "" if same else "the rerun's copy differs from the source",
                f"left behind: {left}" if left else "",
            ],
        )
    )
    return Trial(wait, finished, not bad, rerun.returncode == 0 and same and not left, detail)


class Storm:
    """A plugin: transient errors on a random share of reads, as an overloaded volume
    answers."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self.rng = random.Random(seed)

    @hookimpl
    def loaderplug_open_source(self, path: str, policy: IOPolicy) -> PosixSource:
        storm = self

        class Stormy(PosixSource):
            def pread_into(self, buf: memoryview, offset: int) -> int:
                if storm.rng.random() < storm.rate:
                    code = storm.rng.choice((errno.ENOMEM, errno.EIO, errno.EAGAIN))
                    raise OSError(code, os.strerror(code), path)
                return super().pread_into(buf, offset)

        return Stormy(path, policy)


@dataclass
class Soak:
    """What hydrates under error storms did: files published corrupt (must be none) or
    left partial (none), files reported failed, retries, and the descriptors and RSS
    after each hydrate (flat)."""

    corrupt: int = 0
    partial: int = 0
    failed: int = 0
    retries: int = 0
    descriptors: list[int] = field(default_factory=list)
    resident: list[int] = field(default_factory=list)


def soak(model: Path, local: Path, rounds: int, seed: int, **settings: object) -> Soak:
    """``rounds`` hydrates of ``model`` into ``local`` in this process, each under a storm
    on a random 5-30% of reads."""
    want = files_of(model)
    rng = random.Random(seed)
    result = Soak()
    for n in range(rounds):
        storm = Storm(rng.uniform(0.05, 0.30), seed=n)
        plugins.register(storm)
        try:
            report = hydrate(model, local, check=False, **settings)  # type: ignore[arg-type]
        finally:
            plugins.unregister(storm)
        got = files_of(local)
        failed = {r.path for r in report.failed}
        result.corrupt += sum(got[rel] != want[rel] for rel in got)
        result.corrupt += len(set(got) & failed)  # a failed file must not be published
        result.partial += len(leftovers(local))
        result.failed += len(failed)
        result.retries += report.retries
        shutil.rmtree(local)
        result.descriptors.append(len(os.listdir("/proc/self/fd")))
        with open("/proc/self/statm") as f:
            result.resident.append(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    return result
