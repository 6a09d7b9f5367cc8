"""Helpers the benchmark scripts share: timed child processes and a tiny thread pool."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def compile_loaderplug() -> None:
    """Byte-compile the loaderplug under test, as pip does when it installs a package.

    A checkout imported with ``PYTHONDONTWRITEBYTECODE`` set (or with files changed since
    their bytecode was written) compiles every module it imports, in every process,
    inside the clock: at 4 ranks on this machine that took the first tensor from
    0.78-0.84 s to 1.28-1.93 s. Call it first in a benchmark's main (children's too:
    once compiled, it only looks at the files' times)."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("loaderplug")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        compileall.compile_dir(folder, quiet=1)


def collect_garbage_before_the_clock() -> None:
    """Collect the garbage the child's imports left, just before it starts its clock.

    Importing torch (and starting a process group) leaves a full collection due: at the
    start of a scale child ``gc.get_count()`` is (355, 10, 10), so the first thousand
    allocations of whatever runs next set off a collection of torch's whole heap, which
    stops every thread of the process for 0.15-0.19 s (4 ranks on this machine) inside
    the first tensor, whichever contender runs. The debt is the import's, not a load's;
    every contender's child in scale_bench and onepass_bench (the benchmarks that time a
    first tensor) calls this, so none pays it there."""
    import gc

    gc.collect()


def run_timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stdout of one child; fails loudly on error.

    GNU time reports the RSS: a child forked from this Python process would otherwise
    inherit the benchmark's own high-water mark until it execs.
    """
    started = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", *cmd],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed:\n{done.stdout}\n{done.stderr}")
    return elapsed, int(done.stderr.strip().splitlines()[-1]) * 1024, done.stdout


def run_child(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
    """The figures a benchmark child printed as JSON on its last line, plus its peak
    RSS (``rss``, bytes)."""
    _seconds, rss, out = run_timed(cmd, env)
    figures: dict[str, float] = json.loads(out.strip().splitlines()[-1])
    figures["rss"] = rss
    return figures


def drop_cache(files: Sequence[str | os.PathLike[str]]) -> None:
    """Drop the files from the page cache, so the next read comes from the disk.
    Dirty pages cannot be dropped: each file is fsync'd first."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_results(out: Path, name: str, header: str, table: str, raw: object) -> None:
    """Write ``<out>/<name>.md`` (header, then the table) and ``<name>.json``; print the
    table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(header + table + "\n")
    (out / f"{name}.json").write_text(json.dumps(raw, indent=1))
    print(table)


def run_parallel(items: Sequence[T], workers: int, work: Callable[[T], None]) -> None:
    """Call ``work`` on every item from ``workers`` threads, in order of the list."""
    pending = list(reversed(items))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not pending:
                    return
                item = pending.pop()
            work(item)

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
