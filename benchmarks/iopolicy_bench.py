"""The IO policy measured per mount against both forced modes, on local disk and on the
FUSE mirror, for loads and hydrates.

For each mount the probe runs once, cold (its seconds, its bytes and its choice are in
the table); then every case runs each contender cold, in rounds whose order rotates
(alternating, so a drift of the disk weighs on all three):

* ``direct``: ``LOADERPLUG_DIRECT_IO=on``
* ``buffered``: ``LOADERPLUG_DIRECT_IO=off``
* ``measured``: ``LOADERPLUG_DIRECT_IO=auto`` with the probe's record (what every job
  after a mount's first one does)

and once more ``measured`` with no record yet, so the job itself probes first (a mount's
first job). Times are the jobs' own (their reports), interpreter start-up left out.

    pip install -e '.[bench]' torch==2.13.0
    python benchmarks/iopolicy_bench.py [--quick]

Writes benchmarks/results/iopolicy.md and iopolicy.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_loaderplug, drop_cache, write_results
from scale_bench import write_scale_model

from loaderplug.units import GiB, MiB

HERE = Path(__file__).resolve().parent
FORCED = {"direct": "on", "buffered": "off"}
CONTENDERS = ("direct", "buffered", "measured")
TARGET = 0.97  # the measured policy's speed against the faster forced mode


def job_seconds(command: list[str], env: dict[str, str]) -> float:
    """The seconds a ``loaderplug`` job reports for itself."""
    done = subprocess.run(
        [sys.executable, "-m", "loaderplug", *command, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "LOADERPLUG_PROGRESS": "0", **env},
    )
    if done.returncode != 0:
        raise SystemExit(f"loaderplug {' '.join(command)} failed:\n{done.stderr}")
    seconds: float = json.loads(done.stdout)["seconds"]
    return seconds


def contender_env(contender: str, cache: Path) -> dict[str, str]:
    if contender in FORCED:
        return {"LOADERPLUG_DIRECT_IO": FORCED[contender], "LOADERPLUG_IO_PROBE": "0"}
    probing = {"LOADERPLUG_IO_PROBE": "1", "XDG_CACHE_HOME": str(cache)}
    return {"LOADERPLUG_DIRECT_IO": "auto", **probing}


def probe_mount(sample: Path, cache: Path, backing: list[Path]) -> dict[str, Any]:
    """Measure the mount of ``sample`` cold into ``cache``, as a job's first read would;
    the probe's figures."""
    os.environ["XDG_CACHE_HOME"] = str(cache)
    from loaderplug.storage.io_policy import decide, direct_io_alignment
    from loaderplug.storage.io_probe import remeasure

    drop_cache(backing)
    found = remeasure(str(sample), decide(sample, "auto"), direct_io_alignment(sample))
    if found is None:
        raise SystemExit(f"{sample}: the probe found nothing to measure")
    return {
        "mount": found.mount,
        "chosen": "direct" if found.direct else "buffered",
        "direct_mib_s": found.direct_mib_s,
        "buffered_mib_s": found.buffered_mib_s,
        "probe_s": found.seconds,
        "probe_bytes": found.bytes_read,
    }


def run_case(
    name: str, command: Any, backing: list[Path], cache: Path, rounds: int, empty: Path
) -> dict[str, Any]:
    """Every contender ``rounds`` times, cold, order rotating; then a first job."""
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for r in range(rounds):
        order = CONTENDERS[r % 3 :] + CONTENDERS[: r % 3]
        for contender in order:
            drop_cache(backing)
            times[contender].append(job_seconds(command(), contender_env(contender, cache)))
        print(f"  {name} round {r + 1}: " + ", ".join(f"{c} {times[c][-1]:.2f} s" for c in order))
    shutil.rmtree(empty, ignore_errors=True)
    drop_cache(backing)
    first = job_seconds(command(), contender_env("measured", empty))
    median = {c: statistics.median(t) for c, t in times.items()}
    faster = min(median["direct"], median["buffered"])
    return {
        "case": name,
        "times": times,
        "median": median,
        "first_job_s": first,
        "measured_vs_faster": faster / median["measured"],
        "first_vs_faster": faster / first,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a 1 GiB model, 2 rounds (else 2 GiB, 5)"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    return parser.parse_args()


def load_of(folder: Path) -> Any:
    """The command of a load of ``folder``."""
    return lambda: ["load", str(folder)]


def hydrate_of(folder: Path, local: Path) -> Any:
    """The command of a hydrate of ``folder`` into ``local``, emptied first."""

    def command() -> list[str]:
        shutil.rmtree(local, ignore_errors=True)
        return ["hydrate", "--from", str(folder), "--to", str(local)]

    return command


def measure_mount(
    mount: str, folder: Path, files: list[Path], cache: Path, rounds: int, root: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The probe of the mount ``folder`` lies on, then its load and hydrate cases."""
    probe = probe_mount(folder / files[0].name, cache, files)
    print(f"  {mount}: probe chose {probe['chosen']} ({probe})")
    cases = []
    local = root / "local"
    for job, command in (("load", load_of(folder)), ("hydrate", hydrate_of(folder, local))):
        case = run_case(f"{mount}, {job}", command, files, cache, rounds, root / "empty")
        cases.append(case)
    return {"where": mount, **probe}, cases


def measure(size: int, rounds: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A model of ``size`` bytes on local disk and on the FUSE mirror: each mount's probe,
    and every case."""
    from loaderplug.testing.volume import VolumeProfile, mounted

    profile = VolumeProfile(
        per_stream_bytes_per_s=40 * MiB, mount_bytes_per_s=640 * MiB, latency_s=0.002
    )
    probes: list[dict[str, Any]] = []
    cases: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="iopolicy-", dir=os.environ.get("BENCH_DIR")) as tmp:
        root = Path(tmp)
        model = root / "m" / "model"
        files = write_scale_model(model, size, shards=4)
        drop_cache(files)
        with mounted(model.parent, root / "mnt", profile) as volume:
            on_mount = volume.mountpoint / model.name
            for mount, folder in (("local disk (ext4)", model), ("FUSE mirror", on_mount)):
                cache = root / f"cache-{len(probes)}"
                probe, mount_cases = measure_mount(mount, folder, files, cache, rounds, root)
                probes.append(probe)
                cases += mount_cases
    return probes, cases


def probes_table(probes: list[dict[str, Any]]) -> list[str]:
    lines = [
        "The probe, once per mount, cold (what a mount's first job pays before it reads):\n",
        "| mount | probe chose | direct MiB/s | buffered MiB/s | probe s | probe bytes |",
        "|---|---|---|---|---|---|",
    ]
    for p in probes:
        lines.append(
            f"| {p['where']} | {p['chosen']} | {p['direct_mib_s']:.0f} | "
            f"{p['buffered_mib_s']:.0f} | {p['probe_s']:.2f} | {p['probe_bytes'] / MiB:.0f} MiB |"
        )
    return lines


def cases_table(cases: list[dict[str, Any]], rounds: int) -> list[str]:
    lines = [
        f"Each job cold, the median of {rounds} alternating rounds (job seconds from its "
        f"report); target: measured >= {TARGET} x the faster forced mode's speed.\n",
        "| case | direct s | buffered s | measured s | measured x faster forced | met | "
        "first job s (probe included) | first job x faster forced |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        m = c["median"]
        met = "yes" if c["measured_vs_faster"] >= TARGET else "no"
        lines.append(
            f"| {c['case']} | {m['direct']:.2f} | {m['buffered']:.2f} | {m['measured']:.2f} | "
            f"{c['measured_vs_faster']:.2f} | {met} | {c['first_job_s']:.2f} | "
            f"{c['first_vs_faster']:.2f} |"
        )
    return lines


def main() -> None:
    compile_loaderplug()
    args = parse_args()
    size = GiB if args.quick else 2 * GiB
    rounds = 2 if args.quick else 5
    started = time.perf_counter()
    probes, cases = measure(size, rounds)
    took = time.perf_counter() - started
    lines = [*probes_table(probes), "", *cases_table(cases, rounds)]
    header = (
        "# The IO policy measured per mount\n\n"
        f"Command: `python benchmarks/iopolicy_bench.py{' --quick' if args.quick else ''}`; "
        f"one run, {took / 60:.1f} minutes; a {size / GiB:.1f} GiB model of 4 shards; the "
        "FUSE test volume at 40 MiB/s per stream and 640 MiB/s for the mount.\n\n"
    )
    write_results(
        args.out, "iopolicy", header, "\n".join(lines), {"probes": probes, "cases": cases}
    )


if __name__ == "__main__":
    main()
