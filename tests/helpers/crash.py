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

import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from loaderplug.sinks import is_temp_name
from loaderplug.sync_mark import MARK_NAME
from loaderplug.tree import is_own_name

HELPER = Path(__file__).parent / "slow_hydrate.py"
REPO = Path(__file__).resolve().parent.parent.parent
ENV = {
    "PATH": "/usr/bin:/bin",
    "PYTHONPATH": str(REPO),
    "LOADERPLUG_PROGRESS": "0",
    "LOADERPLUG_CHUNK_BYTES": "64K",
    "LOADERPLUG_SPLIT_THRESHOLD_BYTES": "128K",
    "LOADERPLUG_HYDRATE_WORKERS": "4",
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


def run(args: list[str], delay_s: float | None = None) -> subprocess.Popen[str]:
    slowed = [sys.executable, str(HELPER), str(delay_s)]
    launcher = slowed if delay_s else [sys.executable, "-m", "loaderplug"]
    return subprocess.Popen(
        [*launcher, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


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
