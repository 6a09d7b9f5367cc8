"""Loads to a GPU in fresh processes, alternating, against the other loaders and the two
limits of the host, written to ``gpu.json`` and ``gpu.md``.

    python benchmarks/gpu_processes.py [--models 4096:8,16384:32] [--rounds 3]
        [--dir /nvme/tmp] [--out benchmarks/results] [--baseline /other/checkout]
        [--device cuda]
    python benchmarks/gpu_processes.py --plot benchmarks/results/gpu.json

For each model (MiB:shards), cold (the files dropped from the page cache before each
run) and warm (read through it first), ``--rounds`` rounds, the order of the loaders
turned round each round. Each run is a process of its own, as a cold start is: torch
imported and the device's context made before the clock, then every tensor of the model
on the device, then a synchronize. The loaders: loaderplug's ``iter_tensors``,
safetensors' ``load_file(device=...)``, fastsafetensors' ``fastsafe_open(nogds=True)``
(a clone of each tensor, as its loader in vLLM does) and, where it is installed,
runai-model-streamer's ``SafetensorsStreamer`` (each tensor ``.to(device)``). In the
same run, the limits: the disk's O_DIRECT read rate (8 readers x 64 MiB ranges, no
GPU) and a pinned host-to-device copy (1 GiB, CUDA events). loaderplug also reports its
first tensor and the tensor bytes it copied host to host on the way (0 on the pinned
path). ``--baseline`` times another loaderplug checkout beside this one. ``--device
cpu`` tries everything but the GPU parts on a machine without one; with ``--fake-cuda``
loaderplug's children load to ``"cuda"`` through the stand-in device of
:mod:`loaderplug.testing.fake_device` (its whole CUDA path, its copies on the CPU). ``--plot`` draws
``gpu.png`` from a ``gpu.json`` (matplotlib, on any machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import compile_loaderplug, drop_cache  # benchmarks/ is on sys.path as a script
from gpu_check import warm_cache

from loaderplug.testing.model import write_model
from loaderplug.units import GiB, MiB

ROOT = Path(__file__).resolve().parent.parent
LOADERS = ("loaderplug", "safetensors", "fastsafetensors", "runai")
BASELINE = "loaderplug (baseline)"


# -- one timed load, in a child process ---------------------------------------------------


def load_all(loader: str, files: list[str], device: str) -> dict[str, Any]:
    """Every tensor on ``device`` by ``loader``; loaderplug's figures besides."""
    started = time.perf_counter()
    if loader.startswith("loaderplug"):
        from loaderplug.tensors.reader import iter_tensors

        first, got = 0.0, {}
        load = iter_tensors(files, device=device, progress=False)
        for name, tensor in load:
            first = first or time.perf_counter() - started
            got[name] = tensor
        return {"tensors": len(got), "first": first, "host_copied_bytes": load.host_copied_bytes,
                "pinned_peak_bytes": load.pinned_peak_bytes}  # fmt: skip
    if loader == "safetensors":
        from safetensors.torch import load_file

        got = {k: v for f in files for k, v in load_file(f, device=device).items()}
    elif loader == "fastsafetensors":
        from fastsafetensors import fastsafe_open

        where = "cuda:0" if device == "cuda" else device  # fastsafetensors wants an index
        with fastsafe_open(files, device=where, nogds=True) as f:
            got = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
    else:
        from runai_model_streamer import SafetensorsStreamer

        got = {}
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(files)
            for name, tensor in streamer.get_tensors():
                got[name] = tensor.to(device)
    return {"tensors": len(got)}


def child(loader: str, device: str, files: list[str]) -> None:
    import torch

    if os.environ.get("GPU_FAKE_CUDA") and loader.startswith("loaderplug"):
        # --fake-cuda: loaderplug's CUDA path on the stand-in device, on the CPU.
        from loaderplug.plugins.manager import register
        from loaderplug.testing.fake_device import FakeDevice, FakeDevicePlugin

        register(FakeDevicePlugin(FakeDevice(delay_s=0.0)))
        device = "cuda"
        torch.empty(1)  # the context, for the clock's sake

    else:
        torch.empty(1, device=device)  # the device's context, before the clock
    real_cuda = device.startswith("cuda") and torch.cuda.is_available()
    synchronize = torch.cuda.synchronize if real_cuda else lambda: None
    synchronize()
    import gc

    gc.collect()  # the imports' garbage, not the load's (see common.py)
    started = time.perf_counter()
    figures = load_all(loader, files, device)
    synchronize()
    print(json.dumps({"seconds": time.perf_counter() - started, **figures}))


def timed(loader: str, device: str, files: list[str], baseline: str | None) -> dict[str, Any]:
    """One child's figures, or {"error": its last line}."""
    first = baseline if loader == BASELINE else str(ROOT)
    path = os.pathsep.join(filter(None, [first, os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, __file__, "--child", loader, device, *files],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
    )
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


# -- the limits ---------------------------------------------------------------------------


def disk_direct_gbps(files: list[str], readers: int = 8, span: int = 64 * MiB) -> float:
    """The disk's O_DIRECT read rate: ``readers`` threads reading ``span`` ranges of every
    file, offset-major, into aligned buffers of their own (no GPU), from a cold cache."""
    import mmap

    drop_cache(files)
    sizes = [os.path.getsize(f) for f in files]
    ranges = [
        (f, o)
        for o in range(0, max(sizes), span)
        for f, n in zip(files, sizes, strict=True)
        if o < n
    ]
    lock = threading.Lock()

    def read() -> None:
        buffer = mmap.mmap(-1, span)
        while True:
            with lock:
                if not ranges:
                    return
                path, offset = ranges.pop(0)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                os.preadv(fd, [buffer], offset)
            finally:
                os.close(fd)

    started = time.perf_counter()
    threads = [threading.Thread(target=read) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(sizes) / (time.perf_counter() - started) / 1e9


def pinned_h2d_gbps(device: str, nbytes: int = GiB) -> float | None:
    """A pinned host-to-device copy of ``nbytes``, the best of three, by CUDA events."""
    if not device.startswith("cuda"):
        return None
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return nbytes / best / 1e9


# -- the runs -----------------------------------------------------------------------------


def run_model(files: list[str], loaders: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Every loader, cold then warm, ``args.rounds`` alternating rounds."""
    model: dict[str, Any] = {"bytes": sum(os.path.getsize(f) for f in files)}
    first: list[float] = []
    host_copied: list[int] = []
    for state in ("cold", "warm"):
        runs: dict[str, list[Any]] = {loader: [] for loader in loaders}
        for round_ in range(args.rounds):
            for loader in loaders if round_ % 2 == 0 else loaders[::-1]:
                (drop_cache if state == "cold" else warm_cache)(files)
                figures = timed(loader, args.device, files, args.baseline)
                runs[loader].append(figures.get("seconds", figures.get("error")))
                if loader == "loaderplug" and "seconds" in figures:
                    if state == "cold":
                        first.append(figures["first"])
                    host_copied.append(figures["host_copied_bytes"])
                print(state, loader, figures, flush=True)
        model[state] = runs
    model["first_tensor_s"] = {"loaderplug": first}
    model["host_copied_bytes"] = {"loaderplug": max(host_copied, default=None)}
    return model


def commit_of(root: Path) -> str | None:
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True)
    return done.stdout.decode().strip() or None


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    runai = _importable("runai_model_streamer")
    loaders = [name for name in args.loaders if name != "runai" or runai]
    if args.fake_cuda:
        os.environ["GPU_FAKE_CUDA"] = "1"
    if args.baseline:
        loaders.insert(1, BASELINE)
    results: dict[str, Any] = {
        "device": device_name(args.device),
        "commit": commit_of(ROOT),
        "pinned_h2d_GBps": pinned_h2d_gbps(args.device),
        "disk_direct_GBps": None,
        "models": {},
    }
    for size_mib, shards in args.models:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            files = [str(p) for p in write_model(Path(tmp), size_mib * MiB, shards=shards)]
            rate = disk_direct_gbps(files)
            results["disk_direct_GBps"] = max(rate, results["disk_direct_GBps"] or 0.0)
            timed("loaderplug", args.device, files, None)  # the mount's IO policy, measured
            name = f"{size_mib // 1024}GiB" if size_mib % 1024 == 0 else f"{size_mib}MiB"
            results["models"][name] = run_model(files, loaders, args)
        write(results, args.out)  # each model's as it is done: a run cut short keeps them
    return results


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# -- what is written ----------------------------------------------------------------------


def median(values: list[Any]) -> float | None:
    numbers = [v for v in values if isinstance(v, int | float)]
    return statistics.median(numbers) if numbers else None


def table(results: dict[str, Any]) -> str:
    """One row per model, cache state and loader: each run, the median, GB/s, the
    ratios the targets are stated in."""
    rows = [
        "| model | cache | loader | s (each run) | median s | GB/s (median) | x fastsafetensors "
        "speed | x disk direct | x pinned H2D |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    disk, h2d = results["disk_direct_GBps"], results["pinned_h2d_GBps"]
    for name, model in results["models"].items():
        for state in ("cold", "warm"):
            runs = model[state]
            theirs = median(runs.get("fastsafetensors", []))
            for loader, seconds in runs.items():
                mid = median(seconds)
                each = ", ".join(
                    f"{s:.2f}" if isinstance(s, float) else f"failed: {s}" for s in seconds
                )
                rate = model["bytes"] / mid / 1e9 if mid else None
                rows.append(
                    f"| {name} | {state} | {loader} | {each} | {_f(mid)} | {_f(rate)} | "
                    f"{_f(theirs / mid if theirs and mid else None)} | "
                    f"{_f(rate / disk if rate and disk else None)} | "
                    f"{_f(rate / h2d if rate and h2d else None)} |"
                )
    return "\n".join(rows)


def _run(seconds: float | str) -> str:
    return f"{seconds:.2f}" if isinstance(seconds, float) else f"failed: {seconds}"


def _f(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def summary(results: dict[str, Any]) -> str:
    lines = [
        f"Device: {results['device']}; loaderplug at {results['commit']}. Limits: pinned "
        f"host-to-device {_f(results['pinned_h2d_GBps'])} GB/s, the disk's O_DIRECT reads "
        f"(8 readers x 64 MiB) {_f(results['disk_direct_GBps'])} GB/s.",
    ]
    for name, model in results["models"].items():
        cold = median(model["cold"].get("loaderplug", []))
        first = median(model["first_tensor_s"]["loaderplug"])
        share = f"{first / cold:.0%} of the cold load" if first and cold else "-"
        lines.append(
            f"{name}: loaderplug's first tensor (cold) {_f(first)} s, {share}; tensor bytes "
            f"copied host to host: {model['host_copied_bytes']['loaderplug']}."
        )
    return "\n\n".join(lines)


def write(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(results, indent=1))
    text = f"# GPU: loads to `cuda` in fresh processes\n\n{summary(results)}\n\n{table(results)}\n"
    (out / "gpu.md").write_text(text)
    print(text)


def plot(json_path: Path) -> Path:
    """``gpu.png`` beside ``json_path``: GB/s per loader, model and cache state."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(json_path.read_text())
    labels, values = [], []
    for name, model in results["models"].items():
        for state in ("cold", "warm"):
            for loader, seconds in model[state].items():
                mid = median(seconds)
                labels.append(f"{name} {state} / {loader}")
                values.append(model["bytes"] / mid / 1e9 if mid else 0.0)
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(labels) + 1.6))
    colors = ["#d9480f" if "loaderplug" in label else "#868e96" for label in labels]
    bars = ax.barh(range(len(labels)), values, color=colors)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    for limit, style in (("pinned_h2d_GBps", "--"), ("disk_direct_GBps", ":")):
        if results.get(limit):
            ax.axvline(results[limit], color="#343a40", linestyle=style, label=limit)
    ax.legend(loc="lower right")
    ax.set_title(f"Model to {results['device']}, fresh process per load")
    ax.set_xlabel("GB/s, median (higher is better)")
    ax.bar_label(bars, fmt="%.1f", padding=3)
    fig.tight_layout()
    out = json_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def models(text: str) -> list[tuple[int, int]]:
    """``4096:8,16384:32`` -> [(4096, 8), (16384, 32)]."""
    return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]


def main() -> int:
    compile_loaderplug()
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        loader, device, *files = sys.argv[2:]
        child(loader, device, files)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=models, default=models("4096:8,16384:32"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--baseline", help="another loaderplug checkout's root, timed too")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--loaders", type=lambda s: s.split(","), default=list(LOADERS))
    parser.add_argument(
        "--fake-cuda",
        action="store_true",
        help="loaderplug loads to 'cuda' on the stand-in device of loaderplug.testing (CPU)",
    )
    parser.add_argument("--plot", type=Path, help="draw gpu.png from this gpu.json, only")
    args = parser.parse_args()
    if args.plot:
        print(plot(args.plot))
        return 0
    measure(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
