"""Hydrate from an object-store-like volume: loaderplug against the tools users pick.

One run, contenders alternating round by round (A, B, C, D, then B, C, D, A, ...), each
in its own process so its wall time and peak RSS are its own:

* probe       parallel disjoint 8 MiB range reads of every file, discarded: the mount's limit
* loaderplug  ``loaderplug hydrate`` with default settings, fsync included
* runpod      the ``runpod`` package's ``VolumeCache.hydrate`` (whole-file parallel copies)
* cp -r       one stream per file, one file after another

The volume is the FUSE test volume set like an object-store mount: 40 MiB/s per stream,
320 MiB/s for the mount, 2 ms per request. Then loaderplug's peak RSS is measured on a
1 GiB and a 4 GiB model against its budget (bytes in flight + 150 MiB).

    apt-get install -y fuse3 time && pip install -e '.[bench]'
    python benchmarks/hydrate_bench.py            # full: ~1 GiB models, 3 rounds
    python benchmarks/hydrate_bench.py --quick    # 256 MiB models, 1 round

Writes benchmarks/results/hydrate.md and hydrate.json.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from common import compile_loaderplug, run_parallel, run_timed

from loaderplug.testing.model import write_model
from loaderplug.testing.volume import VolumeProfile, fuse_unavailable_reason, mounted
from loaderplug.units import GiB, MiB, format_size

HERE = Path(__file__).resolve().parent
PROFILE = VolumeProfile(
    per_stream_bytes_per_s=40 * MiB, mount_bytes_per_s=320 * MiB, latency_s=0.002
)
BUDGET_SLACK = 150 * MiB


@dataclass
class Measured:
    seconds: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process."""
    seconds, rss, _out = run_timed(cmd, env)
    return seconds, rss


def probe(folder: str, workers: int = 16, chunk: int = 8 * MiB) -> None:
    """Read every file as disjoint ranges on independent descriptors, offset-major."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    spans = []
    for offset in range(0, max(p.stat().st_size for p in files), chunk):
        spans.extend((p, offset) for p in files if offset < p.stat().st_size)

    def read(span: tuple[Path, int]) -> None:
        path, offset = span
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < chunk:
                n = len(os.pread(fd, chunk - done, offset + done))
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)

    run_parallel(spans, workers, read)


def same_shards(reference: Path, copy: Path) -> bool:
    """Every weight shard of ``reference`` is in ``copy``, byte for byte.

    runpod keeps files under 256 KiB in a tar beside its mirror, so only the shards are
    on the mirror path that the other contenders copy; the shards are what is compared.
    """
    shards = sorted(p.name for p in reference.glob("*.safetensors"))
    return bool(shards) and all(
        filecmp.cmp(reference / name, copy / name, shallow=False) for name in shards
    )


def lay_out_mirror(local: Path, backing: Path, size: int, shards: int) -> int:
    """Write the model to ``local`` and let runpod's own sync lay out its mirror of it,
    straight to the volume's backing folder; the model's shard bytes."""
    write_model(local, size, shards)
    total = sum(p.stat().st_size for p in local.glob("*.safetensors"))
    backing.mkdir()
    from runpod.serverless.utils.rp_volume_cache import VolumeCache

    VolumeCache(dirs=[local], namespace="bench", volume_path=backing, best_effort=False).sync(
        background=False
    )
    return total


def contenders(local: Path, mnt: Path, dst: Path) -> dict[str, tuple[list[str], Path | None]]:
    """Each contender's command, and the folder its copy lands in (None: no copy)."""
    mirror = mnt / ".cache" / "bench" / "big" / str(local).lstrip("/")
    runpod_code = (
        "from runpod.serverless.utils.rp_volume_cache import VolumeCache;"
        f"n = VolumeCache(dirs=[{str(local)!r}], namespace='bench', volume_path={str(mnt)!r},"
        " best_effort=False).hydrate(); assert n > 0, n"
    )
    return {
        "probe (parallel ranges)": ([sys.executable, __file__, "--probe", str(mirror)], None),
        "loaderplug": (
            [
                sys.executable,
                "-m",
                "loaderplug",
                "hydrate",
                "--from",
                str(mirror),
                "--to",
                str(dst),
            ],
            dst,
        ),
        "runpod VolumeCache": ([sys.executable, "-c", runpod_code], local),
        "cp -r": (["cp", "-r", str(mirror), str(dst)], dst),
    }


def run_contender(cmd: list[str], out: Path | None, local: Path) -> tuple[float, int]:
    """One contender's run into an empty ``out`` (runpod's, ``local``, must exist):
    its wall seconds and peak RSS."""
    if out is not None:
        shutil.rmtree(out, ignore_errors=True)
        if out == local:
            out.mkdir(parents=True)
    subprocess.run(["sync"], check=True)
    return run_measured(cmd, env={"LOADERPLUG_PROGRESS": "0"})


def alternate(
    label: str,
    total: int,
    each: dict[str, tuple[list[str], Path | None]],
    rounds: int,
    local: Path,
    local_copy: Path,
) -> dict[str, Measured]:
    """Every contender once a round, the order turned by one each round."""
    results: dict[str, Measured] = {}
    order = list(each)
    for round_ in range(rounds):
        for name in order[round_ % 4 :] + order[: round_ % 4]:
            cmd, out = each[name]
            seconds, rss = run_contender(cmd, out, local)
            m = results.setdefault(name, Measured())
            m.seconds.append(seconds)
            m.rss.append(rss)
            if out is not None and round_ == 0:
                # Compare with the model as written, not through the slow mount.
                assert same_shards(local_copy, out), f"{name} produced a different tree"
            print(
                f"  {label} round {round_ + 1}: {name:24s} {total / MiB / seconds:7.1f} MiB/s",
                flush=True,
            )
    return results


def bench_scenario(work: Path, ram: Path, label: str, size: int, shards: int, rounds: int) -> dict:
    """Alternate the four contenders over one model behind one throttled mount.

    The volume's backing folder lives in memory (``ram``): a network volume shares no
    disk with the worker, so its reads must not compete with the local writes.
    """
    base = work / label.replace(" ", "-")
    local = base / "rp-local" / "model"
    backing = ram / label.replace(" ", "-")
    total = lay_out_mirror(local, backing, size, shards)
    local_copy = base / "reference"
    shutil.copytree(local, local_copy)
    mnt = base / "mnt"
    mnt.mkdir()
    with mounted(backing, mnt, PROFILE):
        each = contenders(local, mnt, base / "dst")
        results = alternate(label, total, each, rounds, local, local_copy)
    return {"label": label, "bytes": total, "shards": shards, "results": results}


def ram_dir() -> str:
    """A memory-backed folder for the volume's backing files, if the machine has one."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3 << 30:
        return str(shm)
    print("note: /dev/shm is missing or small; the volume's backing shares the local disk")
    return tempfile.gettempdir()


def rss_check(work: Path, size: int) -> dict:
    folder = work / f"rss-{size >> 20}"
    write_model(folder / "src", size, 4)
    dst = folder / "dst"
    seconds, rss = run_measured(
        [
            sys.executable,
            "-m",
            "loaderplug",
            "hydrate",
            "--from",
            str(folder / "src"),
            "--to",
            str(dst),
        ],
        env={"LOADERPLUG_PROGRESS": "0"},
    )
    shutil.rmtree(folder)
    budget = 512 * MiB + BUDGET_SLACK
    return {"model_bytes": size, "peak_rss": rss, "budget": budget, "seconds": seconds}


def table(scenarios: list[dict], rss_rows: list[dict]) -> str:
    lines = [
        "| model | contender | MiB/s (median) | min-max | x runpod | x cp -r | of probe "
        "| peak RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for sc in scenarios:
        res: dict[str, Measured] = sc["results"]
        median = {name: sc["bytes"] / MiB / statistics.median(m.seconds) for name, m in res.items()}
        for name, m in res.items():
            speeds = [sc["bytes"] / MiB / s for s in m.seconds]
            lines.append(
                f"| {sc['label']} | {name} | {median[name]:.0f} | "
                f"{min(speeds):.0f}-{max(speeds):.0f} | "
                f"{median[name] / median['runpod VolumeCache']:.2f} | "
                f"{median[name] / median['cp -r']:.2f} | "
                f"{median[name] / median['probe (parallel ranges)']:.0%} | "
                f"{max(m.rss) / MiB:.0f} MiB |"
            )
    lines += [
        "",
        "| model | loaderplug peak RSS | budget (in flight + 150 MiB) | within |",
        "|---|---|---|---|",
    ]
    for row in rss_rows:
        lines.append(
            f"| {format_size(row['model_bytes'])} | {row['peak_rss'] / MiB:.0f} MiB | "
            f"{row['budget'] / MiB:.0f} MiB | "
            f"{'yes' if row['peak_rss'] <= row['budget'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    compile_loaderplug()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB models, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--shards", type=int, nargs="+", default=[4, 1], help="one scenario per shard count"
    )
    parser.add_argument(
        "--rss-gib", type=int, nargs="+", default=[1, 4], help="model sizes of the RSS check"
    )
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.probe:
        probe(args.probe)
        return
    reason = fuse_unavailable_reason()
    if not Path("/usr/bin/time").exists():
        reason = "GNU time is missing (apt-get install time)"
    try:
        import runpod  # noqa: F401
    except ImportError:
        reason = "the runpod package is missing (pip install -e '.[bench]')"
    if reason:
        raise SystemExit(f"this benchmark needs the FUSE test volume: {reason}")
    size = 256 * MiB if args.quick else GiB
    rounds = 1 if args.quick else args.rounds
    with (
        tempfile.TemporaryDirectory(prefix="loaderplug-bench-", dir="/var/tmp") as tmp,
        tempfile.TemporaryDirectory(prefix="loaderplug-bench-", dir=ram_dir()) as ram_tmp,
    ):
        work, ram = Path(tmp), Path(ram_tmp)
        scenarios = [
            bench_scenario(work, ram, f"{n} shard{'s' if n > 1 else ''}", size, n, rounds)
            for n in args.shards
        ]
        sizes: list[int] = [size] if args.quick else [n << 30 for n in args.rss_gib]
        rss_rows = [rss_check(work, s) for s in sizes]
    text = table(scenarios, rss_rows)
    header = (
        f"# Hydrate benchmark\n\nVolume: FUSE test volume over a memory-backed folder, "
        f"40 MiB/s per stream, 320 MiB/s per mount, 2 ms per request; destination on local "
        f"disk. {rounds} round(s), alternating; wall time of each process, start-up "
        f"included (loaderplug's includes fsync; cp's and runpod's have none). Command: "
        f"`python benchmarks/hydrate_bench.py{' --quick' if args.quick else ''}`.\n\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hydrate.md").write_text(header + text + "\n")
    raw = [{**sc, "results": {k: vars(v) for k, v in sc["results"].items()}} for sc in scenarios]
    (args.out / "hydrate.json").write_text(
        json.dumps({"scenarios": raw, "rss": rss_rows}, indent=1)
    )
    print(text)


if __name__ == "__main__":
    main()
