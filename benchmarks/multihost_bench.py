"""Ranks on several hosts: each host's ranks load the model from its own mount of the
mirror, the hosts splitting the reads and exchanging them (or not), against every host
hydrating the whole model side by side.

Simulated hosts on this machine (:mod:`loaderplug.testing.hosts`, root only): a network
namespace, hostname and mount namespace per host, links shaped by ``tc``
(``--links-gbit``), a FUSE mount of the same model folder per host, each with its own
throttle (``--mounts-mib-s``) and byte counter, a local folder per host, torchrun's
variables per rank. For each host count and mount rate the baseline runs first: every
host hydrates the whole model from its own mount at once (``loaderplug.hydrate``, one
process per host), timed to the slowest. Then, per link rate, ranks per host and kind of
load (``one-pass``: ``iter_tensors(files, local_dir=..., group=WORLD)``; ``stream``: no
local copy), each plan (``LOADERPLUG_HOST_SPLIT`` ``off``, ``on`` and ``auto``) until
every rank has had every tensor, touching every page of each and dropping it (as a
loader copying weights to the GPU does). ``off`` does not use the link, so it runs once
per mount and stands for every link.

Figures: mirror bytes per model byte (all mounts together), the slowest rank's time
and its ratio to the side-by-side hydrate of the same run, each rank's first tensor
(and its share of that rank's load), peak RSS per rank (its growth over torch and the
group), CPU seconds per GiB of the model per rank; whether the hosts split, and why.
Auto's time over the better forced plan's, per case. Tensors: the first rank of host 0
and of the last host check every tensor's CRC32 against the file's bytes (outside the
clock), and in a one pass every host's local copy is compared with the model.

    sudo python benchmarks/multihost_bench.py [--quick]

Writes benchmarks/results/multihost.{md,json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from scale_bench import write_scale_model  # noqa: E402

from loaderplug.testing.hosts import SimulatedHosts, host_volumes  # noqa: E402
from loaderplug.testing.volume import VolumeProfile  # noqa: E402
from loaderplug.units import GiB, MiB  # noqa: E402

RESULTS = HERE / "results"


# -- children ---------------------------------------------------------------------------


def rank_child(args: argparse.Namespace) -> None:
    """One rank: join the group by torchrun's variables, load in one pass, print figures."""
    import resource

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    from loaderplug.tensors.reader import iter_tensors

    files = sorted(str(f) for f in Path(args.volume).glob("*.safetensors"))
    check = os.environ.get("BENCH_CHECK") == "1"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    crcs: dict[str, int] = {}
    checking_s = checking_cpu = 0.0
    started, cpu_started = time.perf_counter(), time.process_time()
    first = None
    local = args.local or None  # none: streaming tensors alone
    load = iter_tensors(files, local_dir=local, group=dist.group.WORLD, progress=False)
    for name, tensor in load:
        if first is None:
            first = time.perf_counter() - started
        raw = tensor.reshape(-1).view(torch.uint8)
        if raw.numel():
            raw[::4096].sum()  # touch every page
        if check:  # the CRC's time is not the load's
            at, cpu_at = time.perf_counter(), time.process_time()
            crcs[name] = zlib.crc32(raw.numpy())
            checking_s += time.perf_counter() - at
            checking_cpu += time.process_time() - cpu_at
        del tensor, raw
    seconds = time.perf_counter() - started - checking_s
    cpu = time.process_time() - cpu_started - checking_cpu
    hosts = load.hosts
    done = hosts.exchanged if hosts is not None else None
    print(
        json.dumps(
            {
                "seconds": seconds,
                "first": first,
                "cpu": cpu,
                "rss_growth": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                - rss_before,
                "split": hosts.split if hosts is not None else None,
                "why": hosts.why if hosts is not None else None,
                "mirror_bytes": done.mirror_bytes if done is not None else None,
                "received_bytes": done.received_bytes if done is not None else None,
                "exchange_s": done.exchange_s if done is not None else None,
                "rounds": done.rounds if done is not None else None,
                "crcs": crcs,
            }
        )
    )
    dist.destroy_process_group()


def hydrate_child(args: argparse.Namespace) -> None:
    from loaderplug import hydrate

    started = time.perf_counter()
    hydrate(args.volume, args.local, progress=False)
    print(json.dumps({"seconds": time.perf_counter() - started}))


# -- the parent -------------------------------------------------------------------------


def expected_crcs(files: list[Path]) -> dict[str, int]:
    """Each tensor's CRC32, from the files' bytes."""
    crcs = {}
    for path in files:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
            base = 8 + length
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                begin, end = entry["data_offsets"]
                f.seek(base + begin)
                crcs[name] = zlib.crc32(f.read(end - begin))
    return crcs


def finish(procs: list[subprocess.Popen[str]], what: str) -> list[dict[str, Any]]:
    outs = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=1800)
        if proc.returncode != 0 or not out.strip():
            raise SystemExit(f"{what}: rank {rank} exited {proc.returncode}:\n{err[-4000:]}")
        said = json.loads(out.strip().splitlines()[-1])
        said["peak_rss"] = peak_rss(err)
        outs.append(said)
    return outs


def peak_rss(stderr: str) -> int:
    """The rank's peak RSS, as /usr/bin/time -v says (bytes); 0 where it did not."""
    for line in stderr.splitlines():
        if "Maximum resident set size" in line:
            return int(line.rsplit(":", 1)[1]) * 1024
    return 0


def clear(storages: list[Any]) -> None:
    for storage in storages:
        shutil.rmtree(storage.local, ignore_errors=True)
        storage.local.mkdir()
        storage.volume.reset_stats()


def side_by_side_hydrate(storages: list[Any], env: dict[str, str]) -> dict[str, Any]:
    """Every host hydrating the whole model from its own mount, at once."""
    clear(storages)
    procs = [
        storage.host.popen(
            [
                sys.executable,
                __file__,
                "--hydrate-child",
                "--volume",
                str(storage.volume.mountpoint),
                "--local",
                str(storage.local),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for storage in storages
    ]
    started = time.perf_counter()
    outs = finish(procs, "hydrate")
    wall = time.perf_counter() - started
    mirror = sum(s.volume.stats()["bytes_read"] for s in storages)
    return {"seconds": max(o["seconds"] for o in outs), "wall": wall, "mirror_bytes": mirror}


def ranks_run(
    hosts: SimulatedHosts,
    storages: list[Any],
    ranks: int,
    env: dict[str, str],
    one_pass: bool,
) -> list[dict[str, Any]]:
    clear(storages)
    procs = []
    for rank_env in hosts.torchrun_environments(ranks):
        host = int(rank_env["GROUP_RANK"])
        storage = storages[host]
        checked = rank_env["LOCAL_RANK"] == "0" and host in (0, len(storages) - 1)
        procs.append(
            storage.host.popen(
                [
                    "/usr/bin/time",
                    "-v",
                    sys.executable,
                    __file__,
                    "--rank-child",
                    "--volume",
                    str(storage.volume.mountpoint),
                    "--local",
                    str(storage.local) if one_pass else "",
                ],
                env={**env, **rank_env, "BENCH_CHECK": "1" if checked else "0"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return finish(procs, f"{len(storages)} hosts x {ranks}")


def copies_equal(storages: list[Any], files: list[Path]) -> bool:
    for storage in storages:
        for f in files:
            ok = subprocess.run(["cmp", "-s", str(f), str(storage.local / f.name)]).returncode == 0
            if not ok:
                return False
    return True


def cell(
    hosts: SimulatedHosts,
    storages: list[Any],
    case: dict[str, Any],
    env: dict[str, str],
    files: list[Path],
    want: dict[str, int],
) -> dict[str, Any]:
    """One run's figures: the ranks' slowest, mirror bytes, tensors and copies equal."""
    one_pass = case["kind"] == "one-pass"
    env = {**env, "LOADERPLUG_HOST_SPLIT": case["plan"]}
    outs = ranks_run(hosts, storages, case["ranks_per_host"], env, one_pass)
    model = sum(f.stat().st_size for f in files)
    checked = [o["crcs"] for o in outs if o["crcs"]]
    return {
        **case,
        "hosts": len(storages),
        "slowest_s": max(o["seconds"] for o in outs),
        "first_tensor_s": [o["first"] for o in outs],
        "first_share": max(o["first"] / o["seconds"] for o in outs),
        "rss_growth": [o["rss_growth"] for o in outs],
        "peak_rss": [o["peak_rss"] for o in outs],
        "cpu_s_per_gib": [o["cpu"] / (model / GiB) for o in outs],
        "mirror_per_model": sum(s.volume.stats()["bytes_read"] for s in storages) / model,
        "split": [o["split"] for o in outs],
        "why": outs[0]["why"],
        "exchange": [(o["received_bytes"], o["exchange_s"], o["rounds"]) for o in outs],
        "tensors_equal": bool(checked) and all(c == want for c in checked),
        "copies_equal": copies_equal(storages, files) if one_pass else None,
    }


def cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs at one host count and mount rate: ``off`` once (it does not use the
    link), ``on`` and ``auto`` per link."""
    out = []
    for ranks in args.ranks:
        for kind in args.kinds:
            base = {"ranks_per_host": ranks, "kind": kind}
            out.append({**base, "plan": "off", "link_gbit": None})
            for link in args.links_gbit:
                for plan in ("on", "auto"):
                    out.append({**base, "plan": plan, "link_gbit": link})
    return out


def at_mount(
    args: argparse.Namespace, count: int, mount: float, files: list[Path], env: dict[str, str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The baseline and every run at ``count`` hosts whose mounts read ``mount`` MiB/s."""
    work, want = Path(args.workdir), expected_crcs(files)
    throttle = VolumeProfile(mount_bytes_per_s=mount * MiB)
    rows = []
    with ExitStack() as stack:
        hosts = stack.enter_context(SimulatedHosts(count))
        storages = stack.enter_context(
            host_volumes(hosts, work / "model", work / f"hosts{count}", throttle)
        )
        base = side_by_side_hydrate(storages, env)
        print(f"{count} hosts at {mount:g} MiB/s side by side: {base['seconds']:.1f} s", flush=True)
        for case in cases(args):
            link = case["link_gbit"] or max(args.links_gbit)
            for index in range(count):
                hosts.set_rate(index, link * 1000)
            row = cell(hosts, storages, case, env, files, want)
            row.update(mount_mib_s=mount, hydrate_s=base["seconds"])
            row["ratio"] = row["slowest_s"] / base["seconds"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    shutil.rmtree(work / f"hosts{count}", ignore_errors=True)
    return base, rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    files = write_scale_model(work / "model", int(args.model_gib * GiB), args.shards)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LOADERPLUG_PROGRESS": "0",
        "LOADERPLUG_IO_PROBE": "0",
        "LOADERPLUG_FSYNC": "0",
    }
    cells, baselines = [], {}
    for count in args.hosts:
        for mount in args.mounts_mib_s:
            base, rows = at_mount(args, count, mount, files, env)
            baselines[f"{count}@{mount:g}"] = base
            cells.extend(rows)
    return {
        "date": datetime.date.today().isoformat(),
        "model_bytes": sum(f.stat().st_size for f in files),
        "shards": args.shards,
        "baselines": baselines,
        "cells": cells,
    }


# -- the results ------------------------------------------------------------------------


def table(raw: dict[str, Any]) -> str:
    lines = [
        "| hosts x ranks | load | mount MiB/s | link Gbit/s | plan | split | "
        "mirror bytes / model | slowest rank s | side-by-side hydrate s | ratio | "
        "first tensor s (max) | first tensor / load (max) | peak RSS MiB (max) | "
        "CPU s/GiB per rank (max) | tensors equal | copies equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in raw["cells"]:
        link = "any" if c["link_gbit"] is None else f"{c['link_gbit']:g}"
        copies = "" if c["copies_equal"] is None else str(c["copies_equal"])
        lines.append(
            f"| {c['hosts']} x {c['ranks_per_host']} | {c['kind']} | {c['mount_mib_s']:g} | "
            f"{link} | {c['plan']} | {'yes' if all(c['split']) else 'no'} | "
            f"{c['mirror_per_model']:.3f} | {c['slowest_s']:.1f} | {c['hydrate_s']:.1f} | "
            f"**{c['ratio']:.2f}** | {max(c['first_tensor_s']):.2f} | {c['first_share']:.2f} | "
            f"{max(c['peak_rss']) / MiB:.0f} | {max(c['cpu_s_per_gib']):.2f} | "
            f"{c['tensors_equal']} | {copies} |"
        )
    return "\n".join(lines)


def auto_against_best(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case (hosts, ranks, load, mount, link): auto's time over the better of split
    forced on and off, from the same run."""
    rows = []
    for c in raw["cells"]:
        if c["plan"] != "auto":
            continue
        same = [
            o
            for o in raw["cells"]
            if (o["hosts"], o["ranks_per_host"], o["kind"], o["mount_mib_s"])
            == (c["hosts"], c["ranks_per_host"], c["kind"], c["mount_mib_s"])
        ]
        on = next(o for o in same if o["plan"] == "on" and o["link_gbit"] == c["link_gbit"])
        off = next(o for o in same if o["plan"] == "off")
        best = min(on["slowest_s"], off["slowest_s"])
        rows.append(
            {
                "case": c,
                "on_s": on["slowest_s"],
                "off_s": off["slowest_s"],
                "auto_s": c["slowest_s"],
                "over_best": c["slowest_s"] / best,
                "chose": "split" if all(c["split"]) else "not split",
                "why": c["why"],
            }
        )
    return rows


def auto_table(raw: dict[str, Any]) -> str:
    lines = [
        "| hosts x ranks | load | mount MiB/s | link Gbit/s | split on s | split off s | "
        "auto s | auto / better | auto chose | why |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in auto_against_best(raw):
        c = r["case"]
        lines.append(
            f"| {c['hosts']} x {c['ranks_per_host']} | {c['kind']} | {c['mount_mib_s']:g} | "
            f"{c['link_gbit']:g} | {r['on_s']:.1f} | {r['off_s']:.1f} | {r['auto_s']:.1f} | "
            f"**{r['over_best']:.2f}** | {r['chose']} | {r['why']} |"
        )
    return "\n".join(lines)


def draw(raw: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    split = [c for c in raw["cells"] if c["plan"] == "on"]
    for key in sorted(
        {(c["hosts"], c["ranks_per_host"], c["kind"], c["mount_mib_s"]) for c in split}
    ):
        mine = [
            c
            for c in split
            if (c["hosts"], c["ranks_per_host"], c["kind"], c["mount_mib_s"]) == key
        ]
        label = f"{key[0]} hosts x {key[1]}, {key[2]}, mount {key[3]:g} MiB/s"
        left.plot(
            [c["link_gbit"] for c in mine], [c["ratio"] for c in mine], marker="o", label=label
        )
    over = auto_against_best(raw)
    right.bar(range(len(over)), [r["over_best"] for r in over], color="tab:blue")
    right.axhline(1.05, color="grey", linestyle="--", label="target: auto <= 1.05x the better")
    left.set(
        xlabel="link, Gbit/s", ylabel="split: slowest rank / side-by-side hydrate", xscale="log"
    )
    right.set(xlabel="case (hosts, ranks, load, mount, link)", ylabel="auto / better forced plan")
    left.legend(fontsize=6)
    right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    gib = raw["model_bytes"] / GiB
    fig.suptitle(f"{gib:.1f} GiB in {raw['shards']} shards, simulated hosts on one 2-core machine")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank-child", action="store_true")
    parser.add_argument("--hydrate-child", action="store_true")
    parser.add_argument("--volume")
    parser.add_argument("--local")
    parser.add_argument("--quick", action="store_true", help="2 hosts x 1, 64 MiB/s, 4 Gbit/s")
    parser.add_argument("--model-gib", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--links-gbit", type=float, nargs="+", default=[1, 4, 10])
    parser.add_argument("--mounts-mib-s", type=float, nargs="+", default=[64, 320])
    parser.add_argument("--kinds", nargs="+", default=["one-pass", "stream"])
    parser.add_argument("--workdir", default="/var/tmp/loaderplug-multihost")
    parser.add_argument("--name", default="multihost")
    args = parser.parse_args()
    if args.rank_child:
        return rank_child(args)
    if args.hydrate_child:
        return hydrate_child(args)
    if args.quick:
        args.hosts, args.ranks, args.links_gbit, args.mounts_mib_s = [2], [1], [4], [64]
    raw = run(args)
    header = (
        f"# Ranks on several hosts ({raw['date']})\n\n"
        f"`python benchmarks/multihost_bench.py` ({raw['model_bytes'] / GiB:.1f} GiB, "
        f"{raw['shards']} shards). Ratio: the slowest rank's time over every host hydrating "
        "the whole model side by side, in the same run.\n\n"
    )
    auto = "\n\n## Auto against the better forced plan\n\n" + auto_table(raw) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(header + table(raw) + auto)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(raw, indent=1))
    draw(raw, RESULTS / f"{args.name}.png")
    print(table(raw))


if __name__ == "__main__":
    main()
