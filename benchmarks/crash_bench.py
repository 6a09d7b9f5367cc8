"""Hard to break, measured: kills at random points, resumes after a kill, a soak.

1. kill -9 at random points of ``loaderplug hydrate``, ``sync`` (a first one, and one
   over an older version) and the one pass (``load --to``), twenty trials each
   (loaderplug/testing/crash.py, which the suite runs a few times): what the kill left is
   checked (every published file whole and of one generation), then the rerun
   (it must complete and leave nothing behind).
2. Resuming: a 1 GiB file hydrated from the FUSE test volume (40 MiB/s per stream,
   640 MiB/s for the mount) is killed once 20%, 50% and 80% of it has durably landed;
   the rerun's bytes read from the volume are counted, against what was left plus the
   bytes in flight (readers x range size) at the kill.
3. A soak: fifty hydrates in one process, each under a storm of ENOMEM, EIO and EAGAIN
   on a random 5-30% of reads; corrupt or partial files, descriptors, RSS.
4. An eviction soak: twenty one passes (``load --from --to``) and twenty hydrates of a
   multi-shard model from the FUSE test volume with the habits of a real network
   filesystem (libfuse's node ids as inode numbers, 1% of reads finding a stale handle,
   whole-second mtimes), while the kernel's dentry and inode caches are dropped every
   100 ms (memory pressure; needs root): failed jobs, corrupt files.

    python benchmarks/crash_bench.py [--quick]

Writes benchmarks/results/crash.md and crash.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_loaderplug, write_results

from loaderplug import sync
from loaderplug.jobs.partial import journal_for, read_landed
from loaderplug.testing.crash import files_of, kill_trial, soak
from loaderplug.testing.eviction import evicting, eviction_unavailable_reason
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import VolumeProfile, mounted
from loaderplug.types import Identity
from loaderplug.units import GiB, MiB, format_size

HERE = Path(__file__).resolve().parent

FAST = {"span_bytes": "64K", "split_threshold_bytes": "128K", "readers": 4,
        "retry_base_ms": 1, "retry_max_ms": 4, "progress": False}  # fmt: skip


def kills(root: Path, trials: int) -> tuple[list[str], dict[str, Any]]:
    old, new = root / "old", root / "new"
    write_model(old, 8 * MiB, shards=4, seed=1)
    write_model(new, 8 * MiB, shards=4, seed=2)
    mirror = root / "mirror"
    sync(new, mirror, **FAST)
    rng = random.Random(0)
    shards = {k: v for k, v in files_of(new).items() if k.endswith(".safetensors")}
    cases: dict[str, list[Any]] = {}
    for n in range(trials):
        local = root / f"h{n}"
        cases.setdefault("hydrate", []).append(
            kill_trial(["hydrate", "--from", str(mirror), "--to", str(local)], mirror, local,
                       [files_of(new)], rng, delay_s=0.05)
        )  # fmt: skip
        first = root / f"s{n}"
        cases.setdefault("sync (first)", []).append(
            kill_trial(["sync", "--from", str(new), "--to", str(first)], new, first,
                       [files_of(new)], rng, delay_s=0.05)
        )  # fmt: skip
        over = root / f"o{n}"
        sync(old, over, **FAST)
        cases.setdefault("sync (over an older one)", []).append(
            kill_trial(["sync", "--from", str(new), "--to", str(over)], new, over,
                       [files_of(old), files_of(new)], rng, delay_s=0.05)
        )  # fmt: skip
        onepass = root / f"p{n}"
        cases.setdefault("one pass (load --to)", []).append(
            kill_trial(["load", "--from", str(new), "--to", str(onepass)], new, onepass,
                       [shards], rng, most_s=4)
        )  # fmt: skip
        print(f"  kill round {n + 1}/{trials}")
    lines = [
        "| command | trials | killed mid-way | published files whole, one generation | "
        "rerun completed, nothing left |",
        "|---|---|---|---|---|",
    ]
    raw: dict[str, Any] = {}
    for name, results in cases.items():
        killed = sum(not t.finished_first for t in results)
        whole = sum(t.published_ok for t in results)
        # A one pass publishes the weights only: its rerun is judged on what it did.
        rerun = sum(
            t.rerun_ok or ("load" in name and "rerun exited" not in t.detail
                           and "left behind" not in t.detail)
            for t in results
        )  # fmt: skip
        lines.append(f"| {name} | {len(results)} | {killed} | {whole} | {rerun} |")
        raw[name] = [t.__dict__ for t in results]
    return lines, raw


def resumes(root: Path, size: int) -> tuple[list[str], list[dict[str, Any]]]:
    backing = root / "backing"
    write_model(backing, size, shards=1, tensors_per_shard=64)
    (shard,) = backing.glob("*.safetensors")
    profile = VolumeProfile(per_stream_bytes_per_s=40 * MiB, mount_bytes_per_s=640 * MiB,
                            latency_s=0.001)  # fmt: skip
    env = {**os.environ, "LOADERPLUG_PROGRESS": "0"}
    rows = []
    with mounted(backing, root / "mnt", profile) as vol:
        source = vol.mountpoint / shard.name
        for at in (0.2, 0.5, 0.8):
            local = root / f"local-{at}"
            args = [sys.executable, "-m", "loaderplug", "hydrate",
                    "--from", str(vol.mountpoint), "--to", str(local), "--json"]  # fmt: skip
            proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True)
            journal = journal_for(local / shard.name)
            while True:
                landed = read_landed(local / shard.name, Identity.of(source.stat()))
                if landed is not None and landed.nbytes >= at * shard.stat().st_size:
                    break
                if proc.poll() is not None:
                    raise SystemExit("the hydrate finished before the kill")
                time.sleep(0.005)
            proc.send_signal(signal.SIGKILL)
            proc.communicate()
            landed = read_landed(local / shard.name, Identity.of(source.stat()))
            assert landed is not None and journal.exists()
            vol.reset_stats()
            done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
            report = json.loads(done.stdout)
            read = vol.stats()["bytes_read"]
            left = shard.stat().st_size - landed.nbytes
            in_flight = report["readers"] * report["span_bytes"]
            same = (local / shard.name).read_bytes() == shard.read_bytes()
            rows.append({"kill_at": at, "landed": landed.nbytes, "left": left, "read": read,
                         "in_flight": in_flight, "identical": same})  # fmt: skip
            print(f"  resume after {at:.0%}: read {read / MiB:.0f} MiB, left {left / MiB:.0f}")
            shutil.rmtree(local)
    lines = [
        f"A {format_size(size)} file from the FUSE test volume, killed once a share of it had "
        "durably landed; the rerun's reads from the volume.\n",
        "| killed at | landed | left | rerun read from the volume | left + in flight | "
        "within | copy byte-identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = r["left"] + r["in_flight"]
        lines.append(
            f"| {r['kill_at']:.0%} | {r['landed'] / MiB:.0f} MiB | {r['left'] / MiB:.0f} MiB | "
            f"{r['read'] / MiB:.0f} MiB | {bound / MiB:.0f} MiB | "
            f"{'yes' if r['read'] <= bound else 'no'} | {'yes' if r['identical'] else 'NO'} |"
        )
    return lines, rows


def soaked(root: Path, rounds: int) -> tuple[list[str], dict[str, Any]]:
    model = root / "soak"
    write_model(model, 8 * MiB, shards=4)
    result = soak(model, root / "soak-local", rounds, seed=5, **FAST)
    fds, rss = result.descriptors, result.resident
    corrupt, partial, failed_files, retries = (
        result.corrupt, result.partial, result.failed, result.retries
    )  # fmt: skip
    lines = [
        f"{rounds} hydrates of an 8 MiB, 4-shard model in one process, each under "
        "ENOMEM/EIO/EAGAIN on a random 5-30% of reads.\n",
        "| hydrates | retries | failed files (reported) | corrupt files | partial files left | "
        "descriptors (min-max) | RSS (min-max) |",
        "|---|---|---|---|---|---|---|",
        f"| {rounds} | {retries} | {failed_files} | {corrupt} | {partial} | "
        f"{min(fds)}-{max(fds)} | {min(rss) / MiB:.0f}-{max(rss) / MiB:.0f} MiB |",
    ]
    return lines, result.__dict__


def evicted(root: Path, rounds: int, size: int) -> tuple[list[str], dict[str, Any]]:
    reason = eviction_unavailable_reason()
    if reason is not None:
        return [f"Not run: {reason}."], {"skipped": reason}
    backing = root / "evict-backing"
    write_model(backing, size, shards=4)
    want = files_of(backing)
    weights = {k: v for k, v in want.items() if k.endswith(".safetensors")}
    profile = VolumeProfile(inode_numbers="node-ids", stale_handles=0.01,
                            whole_second_mtimes=True, seed=17)  # fmt: skip
    env = {**os.environ, "LOADERPLUG_PROGRESS": "0"}
    commands = {
        "one pass (load --from --to)": (["load", "--from"], weights),
        "hydrate": (["hydrate", "--from"], want),
    }
    counts = {name: {"jobs": 0, "failed": 0, "corrupt": 0, "retries": 0} for name in commands}
    errors: list[str] = []
    with mounted(backing, root / "evict-mnt", profile) as vol, evicting(0.1) as eviction:
        for n in range(rounds):
            for name, (verb, expect) in commands.items():
                local = root / f"evict-{n}-{verb[0]}"
                args = [sys.executable, "-m", "loaderplug", *verb, str(vol.mountpoint),
                        "--to", str(local), "--json"]  # fmt: skip
                done = subprocess.run(args, env=env, capture_output=True, text=True)
                row = counts[name]
                row["jobs"] += 1
                if done.returncode != 0:
                    row["failed"] += 1
                    errors.append(f"{name}: {done.stderr.strip().splitlines()[-1:]}")
                else:
                    out = json.loads(done.stdout)
                    row["retries"] += (out.get("report") or out)["retries"]
                got = files_of(local)
                # A failed job may leave files out, never a wrong one; a job that
                # succeeded leaves every one.
                whole = done.returncode == 0
                row["corrupt"] += sum(
                    got.get(k) != v and (whole or k in got) for k, v in expect.items()
                )
                shutil.rmtree(local, ignore_errors=True)
            print(f"  eviction soak round {n + 1}/{rounds}: {eviction.drops} drops so far")
        stats = vol.stats()
    lines = [
        f"{rounds} one passes and {rounds} hydrates of a {format_size(size)}, 4-shard model "
        "from the FUSE test volume with libfuse's node ids as inode numbers, 1% of reads "
        "finding a stale handle (ESTALE) and whole-second mtimes, the kernel's dentry and "
        f"inode caches dropped every 100 ms ({eviction.drops} drops, "
        f"{stats['stale_handles']} stale handles met).\n",
        "| command | jobs | failed | corrupt or missing files | retries |",
        "|---|---|---|---|---|",
    ]
    for name, row in counts.items():
        lines.append(f"| {name} | {row['jobs']} | {row['failed']} | {row['corrupt']} | "
                     f"{row['retries']} |")  # fmt: skip
    lines += [f"\n{e}" for e in errors[:5]]
    raw = {"counts": counts, "drops": eviction.drops, "volume": stats, "errors": errors}
    return lines, raw


def main() -> None:
    compile_loaderplug()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="3 trials, 256 MiB, 10 hydrates, 5 evicted rounds"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    trials, size, rounds = (3, 256 * MiB, 10) if args.quick else (20, GiB, 50)
    evicted_rounds = 5 if args.quick else 20
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="crash-") as tmp:
        root = Path(tmp)
        kill_lines, kill_raw = kills(root, trials)
        resume_lines, resume_raw = resumes(root, size)
        soak_lines, soak_raw = soaked(root, rounds)
        evict_lines, evict_raw = evicted(root, evicted_rounds, 256 * MiB)
    took = time.perf_counter() - started
    header = (
        "# Hard to break\n\nCommand: `python benchmarks/crash_bench.py"
        f"{' --quick' if args.quick else ''}`; one run, {took / 60:.1f} minutes.\n\n"
    )
    table = "\n\n".join([
        "## kill -9 at random points\n\n" + "\n".join(kill_lines),
        "## Resuming after a kill\n\n" + "\n".join(resume_lines),
        "## Soak under error storms\n\n" + "\n".join(soak_lines),
        "## Soak under memory pressure\n\n" + "\n".join(evict_lines),
    ])  # fmt: skip
    write_results(args.out, "crash", header, table,
                  {"kills": kill_raw, "resumes": resume_raw, "soak": soak_raw,
                   "eviction": evict_raw})  # fmt: skip


if __name__ == "__main__":
    main()
