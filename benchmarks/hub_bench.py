"""Hugging Face hub: a second worker served from the volume mirror against the Hub itself.

A ~1 GiB Llama repo (4 safetensors shards, config, tokenizer, the index) on the local Hub
server (``loaderplug/testing/hub.py``, plain HTTP on loopback), its weight files announced as
Xet-backed as on the Hub. Before timing, loaderplug's ``snapshot_download`` runs once
with the volume's backing folder as ``LOADERPLUG_MIRROR``: it downloads the repo and
copies it to the mirror (``hub/models--org--name/``), which is then laid out as
huggingface_hub >= 2.x lays out a Xet-era ``HF_HOME`` (the weights in the shared store
``hub/blobs/<2 hex>/<xet hash>``, the repo's blobs links into it; ``--layout per-repo``
keeps plain blobs). Then the contenders, each in its own process, alternating round by
round:

* worker 1: Hub download     ``huggingface_hub.snapshot_download(repo, cache_dir=<empty>)``
                             from the server: the plain client
* worker 2: loaderplug ...   ``LOADERPLUG_MIRROR=<mount>``, loaderplug's
                             ``snapshot_download(repo, cache_dir=<empty>)``: hydrated from
                             the mirror, no request to the server (checked)
* huggingface_hub, mirror    ``HF_HUB_CACHE=<mount>/hub HF_HUB_OFFLINE=1``,
  as cache                   ``snapshot_download(repo)``: the path on the mount
* plain hydrate              ``loaderplug.hydrate(<mount>/hub, <empty>)``: the same
                             files (the hub root: the repo folder and the shared store)
                             copied with no hash check, the yardstick for worker 2,
                             which hashes every blob as it copies it
* transformers, stock        ``AutoTokenizer`` and ``AutoModelForCausalLM.from_pretrained
                             (repo, cache_dir=<empty>)`` downloading from the server
* transformers, loaderplug   the same after ``loaderplug...huggingface_hub.install()``
                             with ``LOADERPLUG_MIRROR=<mount>``: served from the mirror

``call s`` is the ``snapshot_download`` call; ``usable s`` adds one sequential read of
every file of the returned snapshot in 16 MiB blocks, one file after another (what a
loader does next). The mount is the FUSE test volume with hydrate_bench's object-store
profile; it opens files with direct_io, so the page cache does not hide its throttle.

    apt-get install -y fuse3 time && pip install -e '.[bench,hf]' pytest
    python benchmarks/hub_bench.py            # full: ~1 GiB repo, 3 rounds
    python benchmarks/hub_bench.py --quick    # 256 MiB repo, 1 round

Writes benchmarks/results/hub.md and hub.json.
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (  # benchmarks/ is on sys.path when run
    compile_loaderplug,
    run_timed,
    write_results,
)

from loaderplug.units import GiB, MiB

# Only the standard library at the top: a child's peak RSS is the contender's own.
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REPO = "bench-org/bench-model"
BLOCK = 16 * MiB
HUB = "worker 1: Hub download"
LOADERPLUG = "worker 2: loaderplug from the mirror"
MOUNT = "huggingface_hub, mirror as cache"
PLAIN = "plain loaderplug hydrate of the hub folder"
TF_HUB = "worker 1: transformers, stock download"
TF_LOADERPLUG = "worker 2: transformers with loaderplug"
SNAPSHOTS = [HUB, LOADERPLUG, MOUNT, PLAIN]
TRANSFORMERS = [TF_HUB, TF_LOADERPLUG]
NAMES = SNAPSHOTS + TRANSFORMERS


def read_snapshot(folder: str) -> tuple[int, int]:
    """Read every file under ``folder`` once (links followed), in 16 MiB blocks, files in
    path order; the bytes and files read."""
    paths = sorted(
        os.path.relpath(os.path.join(root, name), folder)
        for root, _dirs, files in os.walk(folder)
        for name in files
    )
    view = memoryview(bytearray(BLOCK))
    total = 0
    for rel in paths:
        with open(os.path.join(folder, rel), "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, len(paths)


def child(name: str, repo: str, cache_dir: str) -> dict[str, object]:
    """One contender's run, timed from just before the call (imports excluded)."""
    if name in TRANSFORMERS:
        return from_pretrained(name, repo, cache_dir)
    if name == PLAIN:
        from loaderplug import hydrate

        folder = "models--" + repo.replace("/", "--")
        started = time.perf_counter()
        hydrate(os.environ["BENCH_MIRROR"], cache_dir)
        path = max(Path(cache_dir, folder, "snapshots").iterdir())  # the one commit
    else:
        if name == LOADERPLUG:
            from loaderplug.integrations.huggingface_hub import snapshot_download
        else:
            from huggingface_hub import snapshot_download
        kwargs = {"cache_dir": cache_dir} if cache_dir else {}
        started = time.perf_counter()
        path = snapshot_download(repo, **kwargs)
    call = time.perf_counter() - started
    nbytes, nfiles = read_snapshot(path)
    usable = time.perf_counter() - started
    return {
        "call_s": call,
        "usable_s": usable,
        "bytes": nbytes,
        "files": nfiles,
        "path": str(path),
    }


def from_pretrained(name: str, repo: str, cache_dir: str) -> dict[str, object]:
    """A transformers user's start: tokenizer and model by repo id; ``usable s`` is the
    model ready on the CPU."""
    import transformers

    if name == TF_LOADERPLUG:
        from loaderplug.integrations import huggingface_hub as lp_hub

        lp_hub.install()
    started = time.perf_counter()
    transformers.AutoTokenizer.from_pretrained(repo, cache_dir=cache_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(repo, cache_dir=cache_dir)
    usable = time.perf_counter() - started
    snapshot = max(Path(cache_dir, "models--" + repo.replace("/", "--"), "snapshots").iterdir())
    files = sorted(p for p in snapshot.iterdir())
    assert model.num_parameters() > 0
    return {
        "call_s": usable,
        "usable_s": usable,
        "bytes": sum(p.stat().st_size for p in files),
        "files": len(files),
        "path": str(snapshot),
    }


def check_mirror(mirror: Path, sha: str, src: Path, names: list[str]) -> None:
    """The fill left a complete mirror: ref, listing, snapshot links to the right bytes."""
    ref = mirror / "refs" / "main"
    assert ref.is_file() and ref.read_text().strip() == sha, f"{ref}: not {sha}"
    assert (mirror / "trees" / f"{sha}.json").is_file(), f"no listing for {sha} in {mirror}"
    snapshot = mirror / "snapshots" / sha
    for name in names:
        assert (snapshot / name).is_symlink(), f"{snapshot / name} is not a snapshot link"
        assert filecmp.cmp(src / name, snapshot / name, shallow=False), f"{name} differs"


def spread(values: list[int]) -> str:
    return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def transformers_table(results: dict[str, list[dict]]) -> str:
    usable = {n: statistics.median(r["usable_s"] for r in results[n]) for n in TRANSFORMERS}
    lines = [
        "| contender | from_pretrained s (median) | min-max | x stock | Hub file requests "
        "| Hub API requests | peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in TRANSFORMERS:
        runs = results[n]
        times = [r["usable_s"] for r in runs]
        lines.append(
            f"| {n} | {usable[n]:.2f} | {min(times):.2f}-{max(times):.2f} | "
            f"{usable[TF_HUB] / usable[n]:.2f} | {spread([r['file_requests'] for r in runs])} | "
            f"{spread([r['requests'] - r['file_requests'] for r in runs])} | "
            f"{max(r['rss'] for r in runs) / MiB:.0f} MiB |"
        )
    return "\n".join(lines)


def table(results: dict[str, list[dict]], total: int) -> str:
    usable = {n: statistics.median(r["usable_s"] for r in results[n]) for n in SNAPSHOTS}
    speed = {n: total / MiB / usable[n] for n in SNAPSHOTS}
    lines = [
        "| contender | call s (median) | usable s (median) | min-max (usable) | MiB/s (usable) "
        "| x Hub download | x mirror as cache | call x plain hydrate | Hub file requests "
        "| peak RSS |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    call = {n: statistics.median(r["call_s"] for r in results[n]) for n in SNAPSHOTS}
    for n in SNAPSHOTS:
        runs = results[n]
        times = [r["usable_s"] for r in runs]
        lines.append(
            f"| {n} | {statistics.median(r['call_s'] for r in runs):.2f} | {usable[n]:.2f} | "
            f"{min(times):.2f}-{max(times):.2f} | {speed[n]:.0f} | "
            f"{speed[n] / speed[HUB]:.2f} | {speed[n] / speed[MOUNT]:.2f} | "
            f"{call[PLAIN] / call[n]:.2f} | {spread([r['file_requests'] for r in runs])} | "
            f"{max(r['rss'] for r in runs) / MiB:.0f} MiB |"
        )
    return "\n".join(lines)


def missing_requirement() -> str | None:
    """Why this machine cannot run the benchmark, or None if it can."""
    from loaderplug.testing.volume import fuse_unavailable_reason

    reason = fuse_unavailable_reason()
    if not Path("/usr/bin/time").exists():
        reason = "GNU time is missing (apt-get install time)"
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        reason = "huggingface_hub is missing (pip install -e '.[hf]')"
    return reason


def forget_client_settings() -> None:
    """The children get exactly the settings this benchmark gives them, none inherited
    from this shell."""
    for name in list(os.environ):
        if name.startswith(("HF_", "HUGGING_FACE_", "LOADERPLUG_")) or name in (
            "TRANSFORMERS_OFFLINE",
            "TRANSFORMERS_CACHE",
        ):
            del os.environ[name]


@dataclass
class Stage:
    """What every run shares: the Hub server with the repo on it, the children's
    settings, and the repo's files to check each snapshot against."""

    server: Any
    env: dict[str, str]
    src: Path
    names: list[str]
    total: int

    def run(self, name: str, cache: Path | None, extra: dict[str, str]) -> dict:
        """One contender's child in an empty ``cache``: its figures, peak RSS and the
        requests the Hub server saw from it."""
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)
            cache.mkdir(parents=True)
        subprocess.run(["sync"], check=True)
        server = self.server
        seen, seen_files = len(server.requests), server.file_requests()
        script = [sys.executable, __file__, "--child"]
        _s, rss, out = run_timed([*script, name, REPO, str(cache or "")], {**self.env, **extra})
        figures = json.loads(out.strip().splitlines()[-1])
        figures["rss"] = rss
        figures["requests"] = len(server.requests) - seen
        figures["file_requests"] = server.file_requests() - seen_files
        assert figures["bytes"] == self.total and figures["files"] == len(self.names), figures
        return figures


def put_repo(server: Any, src: Path, size: int) -> tuple[list[str], str]:
    """Write a Llama of about ``size`` bytes to ``src`` and serve it as :data:`REPO`,
    its weights announced as Xet-backed: its file names and commit."""
    from loaderplug.testing.tiny_llama import write_tiny_llama

    # A real Llama (transformers loads it): 16 layers of 1024 make about 1 GiB.
    layers = max(1, round(16 * size / GiB))
    write_tiny_llama(src, shards=4, hidden_size=1024, num_layers=layers, intermediate_size=4096)
    names = sorted(p.name for p in src.iterdir())
    server.announce_xet = True
    sha = server.add_repo(REPO, {n: (src / n).read_bytes() for n in names})
    return names, sha


def fill_mirror(stage: Stage, work: Path, backing: Path, sha: str, layout: str) -> dict:
    """Fill the mirror once, straight into the volume's backing folder (no throttle),
    laid out as ``layout`` asks; the fill's figures."""
    from loaderplug.testing.hub import share_blobs

    fill = stage.run(LOADERPLUG, work / "fill-cache", {"LOADERPLUG_MIRROR": str(backing)})
    assert fill["file_requests"] > 0, f"the fill did not download: {fill}"
    shutil.rmtree(work / "fill-cache")
    mirror = backing / "hub" / "models--bench-org--bench-model"
    check_mirror(mirror, sha, stage.src, stage.names)
    print(f"  mirror filled: {fill['call_s']:.2f} s (download + copy to the mirror)")
    if layout == "shared":
        shared = share_blobs(backing / "hub")
        check_mirror(mirror, sha, stage.src, stage.names)
        print(f"  mirror laid out with the shared Xet store: {shared} blobs in it")
    return fill


def contenders(work: Path, mnt: Path) -> dict[str, tuple[Path | None, dict[str, str], Path]]:
    """Each contender's cache (emptied before each run; None for none), settings, and
    the folder its snapshot must lie in."""
    return {
        HUB: (work / "cache-hub", {}, work / "cache-hub"),
        LOADERPLUG: (work / "cache-lp", {"LOADERPLUG_MIRROR": str(mnt)}, work / "cache-lp"),
        MOUNT: (None, {"HF_HUB_CACHE": str(mnt / "hub"), "HF_HUB_OFFLINE": "1"}, mnt),
        PLAIN: (work / "cache-plain", {"BENCH_MIRROR": str(mnt / "hub")}, work / "cache-plain"),
        TF_HUB: (work / "cache-tf-hub", {}, work / "cache-tf-hub"),
        TF_LOADERPLUG: (
            work / "cache-tf-lp",
            {"LOADERPLUG_MIRROR": str(mnt)},
            work / "cache-tf-lp",
        ),
    }


def check_requests(server: Any, name: str, figures: dict) -> None:
    """Worker 2 asks which commit main names (one request, as stock does) and the
    commit's file listing (the Hub, not the mirror, says what a commit holds); transformers
    makes its own API calls; no file may come from the Hub but for the stock downloads."""
    api = figures["requests"] - figures["file_requests"]
    allowed = {HUB: None, TF_HUB: None, LOADERPLUG: 2, TF_LOADERPLUG: api}
    most = allowed.get(name, 0)
    too_many = most is not None and (figures["file_requests"] or api > most)
    if too_many:
        raise SystemExit(
            f"{name} sent {figures['requests']} request(s) to the Hub server: "
            f"{server.requests[-figures['requests'] :][:8]}"
        )


def check_snapshot(
    stage: Stage, name: str, figures: dict, inside: Path, compare_bytes: bool
) -> None:
    """The snapshot lies where the contender's settings put it and, if
    ``compare_bytes``, holds the repo's bytes."""
    path = Path(figures["path"])
    where = Path(os.path.realpath(path))
    assert where.is_relative_to(os.path.realpath(inside)), f"{name}: {path}"
    if compare_bytes:
        src, names = stage.src, stage.names
        assert all(filecmp.cmp(src / n, path / n, shallow=False) for n in names), (
            f"{name}: the snapshot differs from the repo"
        )


def run_rounds(stage: Stage, work: Path, mnt: Path, rounds: int) -> dict[str, list[dict]]:
    """Every contender once a round, the order turned by one each round; their figures."""
    results: dict[str, list[dict]] = {n: [] for n in NAMES}
    each = contenders(work, mnt)
    for round_ in range(rounds):
        for name in NAMES[round_ % len(NAMES) :] + NAMES[: round_ % len(NAMES)]:
            cache, extra, inside = each[name]
            figures = stage.run(name, cache, extra)
            check_requests(stage.server, name, figures)
            check_snapshot(stage, name, figures, inside, cache is not None and round_ == 0)
            results[name].append(figures)
            print(
                f"  round {round_ + 1}: {name:36s} call {figures['call_s']:6.2f} s"
                f"  usable {figures['usable_s']:6.2f} s",
                flush=True,
            )
    return results


def hub_header(total: int, rounds: int, args: argparse.Namespace) -> str:
    return (
        f"# Hugging Face hub benchmark\n\n{total / MiB:.0f} MiB Llama repo (4 safetensors "
        f"shards, config, tokenizer, index; weights announced as Xet-backed) on the local Hub "
        f"server (loaderplug/testing/hub.py, plain HTTP on "
        f"loopback); mirror (filled once beforehand by loaderplug's snapshot_download, "
        f"layout: {args.layout}) on "
        f"the FUSE test volume over a memory-backed folder, 40 MiB/s per stream, 320 MiB/s "
        f"per mount, 2 ms per request, direct_io; local caches on local disk, empty at the "
        f"start of each run. Worker 1: `huggingface_hub.snapshot_download` from the server. "
        f"Worker 2: loaderplug's `snapshot_download` with `LOADERPLUG_MIRROR` on the mount. "
        f"Mirror as cache: `huggingface_hub.snapshot_download` with `HF_HUB_CACHE` on the "
        f"mount and `HF_HUB_OFFLINE=1`. {rounds} round(s), alternating; wall time inside "
        f"each process (imports excluded): call s is the snapshot_download call, usable s "
        f"adds one sequential read of every file of the returned snapshot in 16 MiB blocks. "
        f"Plain hydrate: `loaderplug.hydrate` of the mirror's hub folder (the same files, no "
        f"hash check). Transformers: `AutoTokenizer` then `AutoModelForCausalLM."
        f"from_pretrained` by repo id, stock against the server, and with loaderplug's hooks "
        f"and the mirror; x stock: the stock time over this one. x columns: usable MiB/s "
        f"over that contender's; call x plain hydrate: "
        f"the plain hydrate's call time over this one's. Hub file requests: HEAD and GET "
        f"to `/resolve/` per run. Command: "
        f"`python benchmarks/hub_bench.py{' --quick' if args.quick else ''}`.\n\n"
    )


def raw_results(
    stage: Stage, sha: str, rounds: int, layout: str, fill: dict, results: dict
) -> dict[str, object]:
    from hydrate_bench import PROFILE

    return {
        "repo": REPO,
        "commit": sha,
        "bytes": stage.total,
        "files": len(stage.names),
        "rounds": rounds,
        "layout": layout,
        "profile": {
            "per_stream_bytes_per_s": PROFILE.per_stream_bytes_per_s,
            "mount_bytes_per_s": PROFILE.mount_bytes_per_s,
            "latency_s": PROFILE.latency_s,
        },
        "fill": fill,
        "results": results,
    }


def bench(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    from hydrate_bench import PROFILE, ram_dir

    from loaderplug.testing.hub import HubServer, client_env
    from loaderplug.testing.volume import mounted

    reason = missing_requirement()
    if reason:
        raise SystemExit(f"this benchmark needs the FUSE test volume and the Hub client: {reason}")
    size = 256 * MiB if args.quick else GiB
    rounds = 1 if args.quick else args.rounds
    forget_client_settings()
    with (
        tempfile.TemporaryDirectory(prefix="hub-bench-", dir="/var/tmp") as tmp,
        tempfile.TemporaryDirectory(prefix="hub-bench-", dir=ram_dir()) as ram,
        HubServer() as server,
    ):
        work = Path(tmp)
        src = work / "src"
        names, sha = put_repo(server, src, size)
        total = sum((src / n).stat().st_size for n in names)
        env = {**client_env(server.endpoint, work / "hf_home"), "LOADERPLUG_PROGRESS": "0"}
        stage = Stage(server, env, src, names, total)
        backing = Path(ram) / "backing"
        backing.mkdir()
        fill = fill_mirror(stage, work, backing, sha, args.layout)
        mnt = work / "mnt"
        mnt.mkdir()
        with mounted(backing, mnt, PROFILE):
            results = run_rounds(stage, work, mnt, rounds)
    text = table(results, total) + "\n\n" + transformers_table(results)
    raw = raw_results(stage, sha, rounds, args.layout, fill, results)
    write_results(args.out, "hub", hub_header(total, rounds, args), text, raw)


def main() -> None:
    compile_loaderplug()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB repo, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--layout",
        choices=("shared", "per-repo"),
        default="shared",
        help="the mirror's layout: the shared Xet store (as huggingface_hub >= 2.x writes "
        "HF_HOME), or plain blobs per repo",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    bench(args)


if __name__ == "__main__":
    main()
