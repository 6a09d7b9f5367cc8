"""Loading at scale: host memory as the model grows, and ranks that share a load.

Three tables from one run, contenders alternating within each case:

* **memory**: peak RSS of one process loading a 1, 4 and 8 GiB model (8 shards, a few
  hundred tensors, the largest 100 MiB) cold from local disk, the consumer using and
  dropping each tensor at once (as a loader copying weights to the GPU does):
  loaderplug, safetensors ``safe_open`` and fastsafetensors (``cpu``, ``nogds``), against
  the bound ``bytes in flight + 2 x largest tensor + 256 MiB``.
* **ranks, local disk, cold**: N = 1, 2, 4 processes each until it has had every tensor
  of the 4 GiB model: loaderplug sharing the load over a gloo group, loaderplug with
  ``LOADERPLUG_DISTRIBUTED=off`` (each rank reads everything), ``safe_open`` per rank,
  and fastsafetensors' ParallelLoader over the same gloo group. Wall time (from launch to
  the last rank's last tensor), bytes read from the block device (``/sys/block``), and
  the largest peak RSS of a rank.
* **ranks, from the mirror**: the same model on the FUSE test volume (40 MiB/s per
  stream, 640 MiB/s for the mount), N = 1, 2, 4 ranks loading it in one pass into an
  empty local copy; the volume's bytes, wall time against the volume's floor (model /
  mount bandwidth) and against a plain ``loaderplug hydrate`` of the model from the
  same mount in the same run, and each rank's first tensor.

    pip install -e '.[bench]' torch==2.13.0 safetensors fastsafetensors
    python benchmarks/scale_bench.py [--quick]

Writes benchmarks/results/scale.md and scale.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    collect_garbage_before_the_clock,
    compile_loaderplug,
    drop_cache,
    run_timed,
    write_results,
)

from loaderplug.testing.model import write_shard
from loaderplug.units import GiB, MiB, format_size

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LARGEST = 100 * MiB
# The rest of each shard, in this repeating pattern: layers' projections and norms.
PATTERN = (40 * MiB, 12 * MiB, 12 * MiB, 4 * MiB, 16 * 1024, 16 * 1024)
IN_FLIGHT = 512 * MiB  # the default bytes in flight


def write_scale_model(folder: Path, total: int, shards: int = 8) -> list[Path]:
    """A model like a real checkpoint: an embedding and a head of LARGEST bytes in the
    first and last shard, the rest in a pattern of big and small tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    per_shard = total // shards
    paths, first = [], 0
    for shard in range(shards):
        sizes = [LARGEST] if shard in (0, shards - 1) else []
        i = 0
        while sum(sizes) + PATTERN[i % len(PATTERN)] <= per_shard:
            sizes.append(PATTERN[i % len(PATTERN)])
            i += 1
        path = folder / f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        write_shard(path, sizes, first, seed=shard)
        first += len(sizes)
        paths.append(path)
    return paths


# -- children ---------------------------------------------------------------------------


def join_group(args: argparse.Namespace) -> Any:
    """The gloo group of ``args.world`` ranks that this child is ``args.rank`` of; None
    for a world of one."""
    if args.world <= 1:
        return None
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init}",
        rank=args.rank,
        world_size=args.world,
        timeout=datetime.timedelta(seconds=600),
    )
    return dist.group.WORLD


def read_all(args: argparse.Namespace, files: list[str], group: Any, used: Any) -> None:
    """Hand every tensor of ``files`` to ``used``, loaded with ``args.contender``."""
    if args.contender.startswith("loaderplug"):
        from loaderplug.tensors.reader import iter_tensors

        local = args.local or None
        for _name, tensor in iter_tensors(files, local_dir=local, group=group, progress=False):
            used(tensor)
            del tensor
    elif args.contender == "safe_open":
        from safetensors import safe_open

        for f in files:
            with safe_open(f, framework="pt") as st:
                for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    used(st.get_tensor(key))
    elif args.contender == "fastsafetensors":
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup

        pg = group if group is not None else SingleGroup()
        loader = SafeTensorsFileLoader(pg, device="cpu", nogds=True)
        ranks = max(1, args.world)
        loader.add_filenames({r: files[r::ranks] for r in range(ranks)})
        buffer = loader.copy_files_to_device()
        for key in buffer.key_to_rank_lidx:
            used(buffer.get_tensor(key))
        buffer.close()
        loader.close()


def child(args: argparse.Namespace) -> None:
    """One process (one rank) of a case: load with ``args.contender``, drop each tensor,
    print the figures as JSON."""
    import torch  # imported before the clock: nobody's load time

    files = [str(f) for f in sorted(Path(args.model).glob("*.safetensors"))]
    group = join_group(args)
    import resource

    # The process's peak before the load (torch, the group): the load's own memory is
    # what the peak grows past it.
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    collect_garbage_before_the_clock()
    started = time.perf_counter()
    cpu_started = time.process_time()  # every thread's CPU, the load's alone
    first: float | None = None
    count = 0

    def used(tensor: Any) -> None:
        nonlocal first, count
        if first is None:
            first = time.perf_counter() - started
        count += 1
        if tensor.numel():
            tensor.reshape(-1).view(torch.uint8)[::4096].sum()  # touch every page

    read_all(args, files, group, used)
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    figures = {"seconds": seconds, "first": first, "count": count, "cpu": cpu}
    print(json.dumps({**figures, "rss_before": rss_before}))


def run_ranks(
    contender: str, model: Path, world: int, env: dict[str, str], local: Path | None = None
) -> list[dict[str, Any]]:
    """Start ``world`` children at once; each one's figures and peak RSS."""
    init = Path(tempfile.mkdtemp(prefix="scale-init-")) / "init"
    procs = []
    for rank in range(world):
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--child", contender,
            "--model", str(model), "--rank", str(rank), "--world", str(world),
            "--init", str(init), "--local", str(local or ""),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(
                ["/usr/bin/time", "-f", "%M", *cmd],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "LOADERPLUG_PROGRESS": "0", **env},
            )
        )
    done = [proc.communicate() for proc in procs]
    failed = [
        f"rank {rank} (exit {proc.returncode}):\n{out}\n{err[-3000:]}"
        for rank, (proc, (out, err)) in enumerate(zip(procs, done, strict=True))
        if proc.returncode != 0
    ]
    if failed:  # every failing rank's own words: the first to fail is not always rank 0
        raise SystemExit(f"{contender} x{world} failed:\n" + "\n".join(failed))
    figures = []
    for out, err in done:
        row = json.loads(out.strip().splitlines()[-1])
        row["rss"] = int(err.strip().splitlines()[-1]) * 1024
        figures.append(row)
    shutil.rmtree(init.parent, ignore_errors=True)
    return figures


# -- measuring --------------------------------------------------------------------------


def rss_bound(world: int, shared: bool) -> int:
    """A rank's bound: its part of the host's bytes in flight + 2 x the largest tensor +
    256 MiB (ranks sharing a load divide the bytes in flight)."""
    part = IN_FLIGHT // world if shared else IN_FLIGHT
    return part + 2 * LARGEST + 256 * MiB


def rss_cell(row: dict[str, Any], bound: int | None) -> str:
    """Peak RSS of the largest rank, how much of it the load added, and (for loaderplug)
    whether it is within the bound."""
    if bound is None:
        return f"{row['rss'] / MiB:.0f} MiB (+{row['rss_growth'] / MiB:.0f})"
    within = "within" if row["rss"] <= bound else "over"
    return f"{row['rss'] / MiB:.0f} MiB (+{row['rss_growth'] / MiB:.0f}, {within} {bound // MiB})"


def block_device_of(path: Path) -> Path:
    dev = os.stat(path).st_dev
    return Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")


def sectors_read(stat: Path) -> int:
    return int(stat.read_text().split()[2]) * 512


def memory_table(root: Path, sizes: list[int]) -> tuple[str, list[dict[str, Any]]]:
    rows = []
    for size in sizes:
        model = root / f"model-{size // GiB}g"
        files = write_scale_model(model, size)
        for contender in ("loaderplug", "safe_open", "fastsafetensors"):
            drop_cache(files)
            wall, rss, out = run_timed(
                [sys.executable, str(Path(__file__).resolve()), "--child", contender,
                 "--model", str(model), "--world", "1"],
                {"LOADERPLUG_PROGRESS": "0"},
            )  # fmt: skip
            row = {"size": size, "contender": contender, "rss": rss, "wall": wall}
            row.update(json.loads(out.strip().splitlines()[-1]))
            rows.append(row)
            print(f"  memory {format_size(size)} {contender:16s} {rss / MiB:6.0f} MiB")
        shutil.rmtree(model)
    bound = IN_FLIGHT + 2 * LARGEST + 256 * MiB
    lines = [
        f"Peak RSS, one process, cold, each tensor dropped once used. Bound for loaderplug: "
        f"bytes in flight + 2 x largest tensor + 256 MiB = {bound // MiB} MiB.\n",
        "| model | reader | peak RSS | within the bound | load s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        within = "yes" if r["rss"] <= bound else "no"
        lines.append(
            f"| {format_size(r['size'])} | {r['contender']} | {r['rss'] / MiB:.0f} MiB | "
            f"{within if r['contender'] == 'loaderplug' else '-'} | {r['seconds']:.2f} |"
        )
    return "\n".join(lines), rows


LOCAL_CONTENDERS = {
    "loaderplug (group, page cache)": ("loaderplug", {"LOADERPLUG_RANK_SHARING": "pagecache"}),
    "loaderplug (group, broadcast)": ("loaderplug", {"LOADERPLUG_RANK_SHARING": "broadcast"}),
    "loaderplug (group, stream)": ("loaderplug", {"LOADERPLUG_RANK_SHARING": "stream"}),
    "loaderplug (each rank alone)": ("loaderplug", {"LOADERPLUG_DISTRIBUTED": "off"}),
    "safe_open per rank": ("safe_open", {}),
    "fastsafetensors (gloo group)": ("fastsafetensors", {}),
}


def local_ranks_row(
    label: str, model: Path, world: int, files: list[Path], model_bytes: int, stat: Path
) -> dict[str, Any]:
    """One case of the local-disk ranks, cold: its row (``failed`` if a rank failed)."""
    contender, env = LOCAL_CONTENDERS[label]
    drop_cache(files)
    before = sectors_read(stat)
    started = time.perf_counter()
    try:
        ranks = run_ranks(contender, model, world, env)
    except SystemExit as exc:
        print(f"  {label} x{world}: failed ({str(exc)[:200]})")
        return {"world": world, "contender": label, "failed": str(exc)[-500:]}
    wall = time.perf_counter() - started
    device = sectors_read(stat) - before
    print(f"  local x{world} {label:30s} {wall:6.2f} s {device / model_bytes:5.2f}x model")
    return {
        "world": world,
        "contender": label,
        "wall": wall,
        "load": max(r["seconds"] for r in ranks),
        "device_bytes": device,
        "rss": max(r["rss"] for r in ranks),
        "rss_growth": max(r["rss"] - r["rss_before"] for r in ranks),
        # CPU of every rank together, per GiB of the model: what carries to a
        # machine with more cores.
        "cpu_per_gib": sum(r.get("cpu", 0.0) for r in ranks) / (model_bytes / GiB),
    }


def local_ranks_lines(rows: list[dict[str, Any]], worlds: list[int], model_bytes: int) -> str:
    lines = [
        f"The {model_bytes / GiB:.1f} GiB model, cold, N processes each until it has had "
        "every tensor. Wall: launch to the last rank's last tensor (start-up included); "
        "load: the slowest rank's load alone.\n",
        "| N | contender | wall s | load s | x safe_open per rank (load) | device bytes "
        "/ model | peak RSS, largest rank (+ in the load, bound) | CPU s per GiB (all ranks) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for world in worlds:
        base = next(
            (r for r in rows if r["world"] == world and r["contender"] == "safe_open per rank"),
            None,
        )
        for r in (r for r in rows if r["world"] == world):
            if "failed" in r:
                lines.append(f"| {world} | {r['contender']} | failed | | | | | |")
                continue
            ratio = f"{r['load'] / base['load']:.2f}" if base and "load" in base else ""
            bound = (
                rss_bound(world, shared="group" in r["contender"])
                if r["contender"].startswith("loaderplug")
                else None
            )
            lines.append(
                f"| {world} | {r['contender']} | {r['wall']:.2f} | {r['load']:.2f} | {ratio} | "
                f"{r['device_bytes'] / model_bytes:.2f} | {rss_cell(r, bound)} | "
                f"{r['cpu_per_gib']:.2f} |"
            )
    return "\n".join(lines)


def local_ranks_table(model: Path, worlds: list[int]) -> tuple[str, list[dict[str, Any]]]:
    files = sorted(model.glob("*.safetensors"))
    model_bytes = sum(f.stat().st_size for f in files)
    stat = block_device_of(files[0])
    rows = [
        local_ranks_row(label, model, world, files, model_bytes, stat)
        for world in worlds
        for label in LOCAL_CONTENDERS
    ]
    return local_ranks_lines(rows, worlds, model_bytes), rows


def plain_hydrate(vol: Any, on_mount: Path, local: Path) -> tuple[float, float]:
    """A plain ``loaderplug hydrate`` of the model from the mount: the process's wall
    seconds and the job's own."""
    shutil.rmtree(local, ignore_errors=True)
    vol.reset_stats()
    hydrate_wall, _rss, out = run_timed(
        [sys.executable, "-m", "loaderplug", "hydrate", "--from", str(on_mount),
         "--to", str(local), "--json"],
        {"LOADERPLUG_PROGRESS": "0"},
    )  # fmt: skip
    # The job's own time, as the ranks' load time is theirs: no interpreter start-up.
    hydrate_s: float = json.loads(out)["seconds"]
    return hydrate_wall, hydrate_s


def mirror_ranks_row(
    vol: Any, on_mount: Path, local: Path, world: int, sharing: str, model_bytes: int
) -> dict[str, Any]:
    """``world`` ranks sharing the load ``sharing``'s way, one pass from the mount into
    an empty ``local``: their row."""
    shutil.rmtree(local, ignore_errors=True)
    vol.reset_stats()
    started = time.perf_counter()
    env = {"LOADERPLUG_RANK_SHARING": sharing}
    ranks = run_ranks("loaderplug", on_mount, world, env, local=local)
    wall = time.perf_counter() - started
    served = vol.stats()["bytes_read"]
    print(f"  mirror x{world}: {wall:.2f} s, volume {served / model_bytes:.2f}x model")
    return {
        "world": world,
        "sharing": sharing if world > 1 else "-",
        "wall": wall,
        "load": max(r["seconds"] for r in ranks),
        "first": max(r["first"] for r in ranks),
        "volume_bytes": served,
        "rss": max(r["rss"] for r in ranks),
        "rss_growth": max(r["rss"] - r["rss_before"] for r in ranks),
        "cpu_per_gib": sum(r.get("cpu", 0.0) for r in ranks) / (model_bytes / GiB),
    }


def mirror_ranks_lines(
    rows: list[dict[str, Any]],
    model_bytes: int,
    floor: float,
    hydrate_s: float,
    hydrate_wall: float,
) -> str:
    lines = [
        f"The {model_bytes / GiB:.1f} GiB model on the FUSE test volume (40 MiB/s per stream, "
        f"640 MiB/s for the mount): N ranks, one pass into an empty local copy. The volume's "
        f"floor: {floor:.2f} s; a plain `loaderplug hydrate` from the same mount in this run: "
        f"{hydrate_s:.2f} s (its report's time; its process took {hydrate_wall:.2f} s). Load: "
        f"from the load's start to the rank's last tensor, torch's import and the group's "
        f"start-up left out, as in the hydrate's figure, and so is the garbage collection "
        f"torch's import left due (each child collects before its clock).\n",
        "| N | sharing | wall s | load s (slowest rank) | x floor (load) | x hydrate (load) | "
        "volume bytes / model | first tensor s (latest rank) | first / load | peak RSS, "
        "largest rank (+ in the load, bound) | CPU s per GiB (all ranks) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['sharing']} | {r['wall']:.2f} | {r['load']:.2f} | "
            f"{r['load'] / floor:.2f} | "
            f"{r['load'] / hydrate_s:.2f} | {r['volume_bytes'] / model_bytes:.2f} | "
            f"{r['first']:.2f} | {r['first'] / r['load']:.0%} | "
            f"{rss_cell(r, rss_bound(r['world'], shared=True))} | "
            f"{r['cpu_per_gib']:.2f} |"
        )
    return "\n".join(lines)


def mirror_ranks_table(
    model: Path, worlds: list[int], root: Path
) -> tuple[str, list[dict[str, Any]]]:
    from loaderplug.testing.volume import VolumeProfile, mounted

    files = sorted(model.glob("*.safetensors"))
    model_bytes = sum(f.stat().st_size for f in files)
    mount_rate = 640 * MiB
    profile = VolumeProfile(
        per_stream_bytes_per_s=40 * MiB, mount_bytes_per_s=mount_rate, latency_s=0.002
    )
    floor = model_bytes / mount_rate
    rows = []
    with mounted(model.parent, root / "mnt", profile) as vol:
        on_mount = vol.mountpoint / model.name
        local = root / "local"
        hydrate_wall, hydrate_s = plain_hydrate(vol, on_mount, local)
        print(f"  mirror: plain hydrate {hydrate_s:.2f} s (floor {floor:.2f} s)")
        modes = ("pagecache", "broadcast", "stream")
        for world, sharing in ((w, m) for w in worlds for m in modes):
            if world == 1 and sharing != "pagecache":
                continue  # one rank shares nothing
            rows.append(mirror_ranks_row(vol, on_mount, local, world, sharing, model_bytes))
    text = mirror_ranks_lines(rows, model_bytes, floor, hydrate_s, hydrate_wall)
    return text, [*rows, {"hydrate_s": hydrate_s, "floor_s": floor}]


def main() -> None:
    compile_loaderplug()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models, N = 1 and 2")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--local", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.contender = args.child
        child(args)
        return
    sizes = [GiB // 4, GiB // 2] if args.quick else [GiB, 4 * GiB, 8 * GiB]
    worlds = [1, 2] if args.quick else [1, 2, 4]
    rank_model_size = GiB // 2 if args.quick else 4 * GiB
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        root = Path(tmp)
        memory, memory_rows = memory_table(root, sizes)
        model = root / "m" / "model"
        write_scale_model(model, rank_model_size)
        local, local_rows = local_ranks_table(model, worlds)
        mirror, mirror_rows = mirror_ranks_table(model, worlds, root)
    took = time.perf_counter() - started
    header = (
        "# Loading at scale\n\nCommand: `python benchmarks/scale_bench.py"
        f"{' --quick' if args.quick else ''}`; one run, {took / 60:.1f} minutes.\n\n"
    )
    table = "\n\n".join(["## Memory\n\n" + memory, "## Ranks, local disk\n\n" + local,
                         "## Ranks, from the mirror\n\n" + mirror])  # fmt: skip
    write_results(
        args.out, "scale", header, table,
        {"memory": memory_rows, "local": local_rows, "mirror": mirror_rows},
    )  # fmt: skip


if __name__ == "__main__":
    main()
