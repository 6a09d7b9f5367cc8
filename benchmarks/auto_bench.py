"""Adaptive concurrency against a sweep of fixed settings, on three kinds of storage.

For each storage profile, ``loaderplug hydrate`` copies one model with every fixed
workers x chunk setting of the sweep (all within the default 512 MiB in flight) and with
``--workers auto``, alternating round by round, each in its own process with default
retries and fsync. The question: does auto reach at least 90% of the best fixed setting
on every profile, with zero failed files?

* network volume   FUSE test volume: 40 MiB/s per stream, 640 MiB/s per mount, 1 ms
* object store     FUSE test volume: 40 MiB/s per stream, 320 MiB/s per mount, 2 ms,
                   ENOMEM for every read past 6 in flight
* local disk       the model on this machine's disk, dropped from the page cache

    apt-get install -y fuse3 time && pip install -e '.[bench]'
    python benchmarks/auto_bench.py            # 1 GiB model, 2 rounds (about 4 minutes)
    python benchmarks/auto_bench.py --quick    # 256 MiB model, 1 round

Writes benchmarks/results/auto.md and auto.json.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common import compile_loaderplug, drop_cache, write_results

from loaderplug.testing.model import write_model
from loaderplug.testing.volume import Fault, VolumeProfile, fuse_unavailable_reason, mounted
from loaderplug.units import GiB, MiB, format_size

HERE = Path(__file__).resolve().parent
ENOMEM_OVER = 6
PROFILES: dict[str, VolumeProfile | None] = {
    "network volume": VolumeProfile.network_volume(),
    "object store": VolumeProfile(
        per_stream_bytes_per_s=40 * MiB,
        mount_bytes_per_s=320 * MiB,
        latency_s=0.002,
        faults=(Fault(errno.ENOMEM, max_inflight=ENOMEM_OVER),),
    ),
    "local disk": None,
}
# workers x chunk, 96-512 MiB in flight: few long ranges to many short ones, with eight
# workers (the fixed default before auto; a 1 GiB model gets 16 MiB ranges) and the object
# store's sweet spot (as many readers as it takes) among them.
SWEEP = tuple(
    (workers, mib * MiB) for workers, mib in ((6, 16), (8, 64), (8, 16), (32, 16), (64, 8))
)
QUICK_SWEEP = ((8, 64 * MiB), (8, 16 * MiB), (32, 16 * MiB))
AUTO = "auto"
DEFAULT = "8 x 16 MiB"


@dataclass
class Runs:
    mib_per_s: list[float] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    retries: list[int] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    workers: list[str] = field(default_factory=list)  # what auto settled at, and its range


def label(workers: int, chunk: int) -> str:
    return f"{workers} x {format_size(chunk)}"


def hydrate(src: Path, dst: Path, flags: list[str]) -> tuple[float, dict, int]:
    """Seconds, the JSON report and peak RSS of one ``loaderplug hydrate`` process. A
    run with failed files is a result, not an error; anything else stops the benchmark."""
    cmd = [sys.executable, "-m", "loaderplug", "hydrate", "--from", str(src), "--to", str(dst)]
    started = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", *cmd, *flags, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "LOADERPLUG_PROGRESS": "0"},
    )
    seconds = time.perf_counter() - started
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise SystemExit(f"{cmd} {flags} failed:\n{done.stdout}\n{done.stderr}") from None
    return seconds, report, int(done.stderr.strip().splitlines()[-1]) * 1024


@contextmanager
def storage(name: str, model: Path, ram: Path, work: Path) -> Iterator[Path]:
    """Where the model is read from under profile ``name``."""
    profile = PROFILES[name]
    if profile is None:
        yield model
        return
    backing = ram / "backing"
    if not backing.exists():
        shutil.copytree(model, backing)
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    with mounted(backing, mnt, profile) as volume:
        yield volume.mountpoint


def bench_profile(
    name: str, model: Path, ram: Path, work: Path, sweep: tuple, rounds: int
) -> dict[str, Runs]:
    settings = {label(w, c): ["--workers", str(w), "--chunk-bytes", str(c)] for w, c in sweep}
    settings[AUTO] = ["--workers", "auto"]
    runs = {key: Runs() for key in settings}
    total = sum(p.stat().st_size for p in model.iterdir())
    dst = work / "dst"
    with storage(name, model, ram, work) as src:
        order = list(settings)
        for round_ in range(rounds):
            shift = round_ % len(order)
            for key in order[shift:] + order[:shift]:
                shutil.rmtree(dst, ignore_errors=True)
                if PROFILES[name] is None:
                    drop_cache(sorted(model.iterdir()))
                seconds, report, rss = hydrate(src, dst, settings[key])
                run = runs[key]
                run.mib_per_s.append(total / MiB / seconds)
                run.failed.append(report["failed"])
                run.retries.append(report["retries"])
                run.rss.append(rss)
                low, high = report.get("readers_range") or (report["readers"],) * 2
                run.workers.append(f"{report['readers']} ({low}-{high})")
                print(
                    f"  {name} round {round_ + 1}: {key:14s} {run.mib_per_s[-1]:6.0f} MiB/s, "
                    f"{report['failed']} failed, {report['retries']} retries",
                    flush=True,
                )
    shutil.rmtree(dst, ignore_errors=True)
    return runs


def table(results: dict[str, dict[str, Runs]]) -> str:
    lines = [
        "| storage | setting | MiB/s (median) | min-max | of best fixed | failed files "
        "| retries | peak RSS | auto ended at (range) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary = [
        "",
        f"| storage | best fixed | auto | auto / best fixed | {DEFAULT} (fixed 8) / best "
        "| auto failed files |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        median = {key: statistics.median(r.mib_per_s) for key, r in runs.items()}
        fixed = {key: m for key, m in median.items() if key != AUTO}
        best = max(fixed, key=lambda key: fixed[key] if not sum(runs[key].failed) else 0)
        for key, run in runs.items():
            lines.append(
                f"| {name} | {key} | {median[key]:.0f} | {min(run.mib_per_s):.0f}-"
                f"{max(run.mib_per_s):.0f} | {median[key] / median[best]:.0%} | "
                f"{sum(run.failed)} | {sum(run.retries)} | {max(run.rss) / MiB:.0f} MiB | "
                f"{', '.join(run.workers) if key == AUTO else ''} |"
            )
        default = "-"
        if DEFAULT in median:
            failed = sum(runs[DEFAULT].failed)
            default = f"{median[DEFAULT] / median[best]:.0%}" + (
                f", {failed} failed files" if failed else ""
            )
        summary.append(
            f"| {name} | {best}: {median[best]:.0f} MiB/s | {median[AUTO]:.0f} MiB/s | "
            f"{median[AUTO] / median[best]:.0%} | {default} | {sum(runs[AUTO].failed)} |"
        )
    return "\n".join(lines + summary)


def main() -> None:
    compile_loaderplug()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB model, one round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    reason = fuse_unavailable_reason()
    if not Path("/usr/bin/time").exists():
        reason = "GNU time is missing (apt-get install time)"
    if reason:
        raise SystemExit(f"this benchmark needs the FUSE test volume: {reason}")
    size = 256 * MiB if args.quick else GiB
    rounds = 1 if args.quick else args.rounds
    sweep = QUICK_SWEEP if args.quick else SWEEP
    shm = Path("/dev/shm")
    ram_root = shm if shm.is_dir() and shutil.disk_usage(shm).free > 2 * size else None
    results: dict[str, dict[str, Runs]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="loaderplug-auto-", dir="/var/tmp") as tmp,
        tempfile.TemporaryDirectory(prefix="loaderplug-auto-", dir=ram_root) as ram_tmp,
    ):
        work, ram = Path(tmp), Path(ram_tmp)
        model = work / "model"
        write_model(model, size, 4)
        for name in PROFILES:
            results[name] = bench_profile(name, model, ram, work, sweep, rounds)
    text = table(results)
    header = (
        f"# Adaptive concurrency against a fixed sweep\n\n"
        f"`loaderplug hydrate` of a {format_size(size)} model (4 shards) with each fixed "
        f"workers x chunk and with `--workers auto`; {rounds} round(s), alternating; wall "
        f"time of each process, fsync and start-up included; default retries. Network "
        f"volume: FUSE test volume, 40 MiB/s per stream, 640 MiB/s per mount, 1 ms. Object "
        f"store: 40 MiB/s per stream, 320 MiB/s per mount, 2 ms, ENOMEM past "
        f"{ENOMEM_OVER} reads in flight. Local disk: the model on this machine's disk, "
        f"dropped from the page cache before each run. Best fixed: the fastest setting "
        f"with no failed file. Command: "
        f"`python benchmarks/auto_bench.py{' --quick' if args.quick else ''}`.\n\n"
    )
    raw = {name: {k: vars(v) for k, v in runs.items()} for name, runs in results.items()}
    write_results(args.out, "auto", header, text, raw)


if __name__ == "__main__":
    main()
