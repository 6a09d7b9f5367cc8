"""A model in a bucket: loaderplug against Run:ai's streamer and a plain download.

A local SeaweedFS (``weed server -s3``) holds a model of ``--sizes-gib`` in 8 shards.
Rows, each a child process timed to its last byte (and its peak RSS by GNU time):

* ``probe``: the store's limit: ranged GETs of 16 and 64 MiB from 32 threads over
  every shard, bytes discarded (obstore), the better kept;
* ``loaderplug hydrate``: ``loaderplug.hydrate(s3://...)`` to local disk;
* ``loaderplug one pass``: ``iter_tensors(urls, local_dir=...)``: tensors and the
  local copy from one read;
* ``loaderplug stream``: ``iter_tensors(urls)``: tensors only;
* ``runai default`` and ``runai cN``: runai-model-streamer's ``SafetensorsStreamer``
  over the same URLs, at its defaults and with ``RUNAI_STREAMER_CONCURRENCY=N``;
* ``download_file``: boto3's ``download_file`` of each shard, one stream
  (``use_threads=False``), the baseline a script would write.

Then the same behind the tests' proxy (``loaderplug.testing.object_proxy``), each
connection limited to ``--link-mib-s`` with 5 ms before every answer: a store far away,
where concurrency decides. Every tensor a row hands over is checked (CRC32 of its
bytes, against the files', the time and CPU it took taken out of the row's).

    python benchmarks/objectstore_bench.py [--sizes-gib 2 8]

Writes benchmarks/results/objectstore.{md,json,png}.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from common import compile_loaderplug, run_child, write_results  # noqa: E402
from scale_bench import write_scale_model  # noqa: E402

from loaderplug.testing.object_proxy import ObjectProxy  # noqa: E402
from loaderplug.testing.object_server import SeaweedS3  # noqa: E402
from loaderplug.units import GiB, MiB  # noqa: E402

BUCKET = "bench"
RUNAI_TUNED = (16, 32)


# -- children -----------------------------------------------------------------------


class Checked:
    """Each tensor's CRC32, the time and CPU the checking took kept apart."""

    def __init__(self) -> None:
        self.crcs: dict[str, int] = {}
        self.wall = self.cpu = 0.0
        self.first: float | None = None

    def add(self, name: str, tensor: Any, started: float) -> None:
        if self.first is None:
            self.first = time.perf_counter() - started
        wall, cpu = time.perf_counter(), time.process_time()
        self.crcs[name] = zlib.crc32(tensor.contiguous().view(-1).view(dtype_u8()).numpy())
        self.wall += time.perf_counter() - wall
        self.cpu += time.process_time() - cpu


def dtype_u8() -> Any:
    import torch

    return torch.uint8


def digest(crcs: dict[str, int]) -> str:
    return hashlib.sha256(json.dumps(sorted(crcs.items())).encode()).hexdigest()[:16]


def child(args: argparse.Namespace) -> None:
    urls = args.urls
    kind = args.child
    checked = Checked()
    cpu, started = time.process_time(), time.perf_counter()
    if kind == "probe":
        probe(urls, args.span_mib * MiB)
    elif kind == "hydrate":
        import loaderplug

        loaderplug.hydrate(urls[0].rsplit("/", 1)[0], args.dst)
    elif kind in ("onepass", "stream"):
        import loaderplug

        local = args.dst if kind == "onepass" else None
        for name, tensor in loaderplug.iter_tensors(urls, local_dir=local):
            checked.add(name, tensor, started)
    elif kind == "runai":
        from runai_model_streamer import SafetensorsStreamer

        with SafetensorsStreamer() as streamer:
            streamer.stream_files(urls)
            for name, tensor in streamer.get_tensors():
                checked.add(name, tensor, started)
    elif kind == "download":
        download(urls, Path(args.dst))
    seconds = time.perf_counter() - started - checked.wall
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_s": time.process_time() - cpu - checked.cpu,
                "first_tensor_s": checked.first,
                "tensors": len(checked.crcs),
                "digest": digest(checked.crcs) if checked.crcs else None,
            }
        )
    )


def probe(urls: list[str], span: int) -> None:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        config={"endpoint": os.environ["AWS_ENDPOINT_URL"]},
        client_options={"allow_http": True, "pool_max_idle_per_host": "64"},
    )
    keys = [u.split(f"s3://{BUCKET}/", 1)[1] for u in urls]
    work = [
        (key, offset, min(span, size - offset))
        for key in keys
        for size in [obstore.head(store, key)["size"]]
        for offset in range(0, size, span)
    ]
    lock = threading.Lock()

    def reader() -> None:
        while True:
            with lock:
                if not work:
                    return
                key, offset, length = work.pop(0)
            obstore.get_range(store, key, start=offset, length=length)

    threads = [threading.Thread(target=reader) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def download(urls: list[str], dst: Path) -> None:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    client = boto3.client("s3", config=Config(s3={"addressing_style": "path"}))
    dst.mkdir(parents=True, exist_ok=True)
    one_stream = TransferConfig(use_threads=False)
    for url in urls:
        key = url.split(f"s3://{BUCKET}/", 1)[1]
        client.download_file(BUCKET, key, str(dst / Path(key).name), Config=one_stream)


# -- the parent -----------------------------------------------------------------------


def expected_digest(files: list[Path]) -> str:
    crcs = {}
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            base = 8 + n
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                start, end = meta["data_offsets"]
                f.seek(base + start)
                crcs[name] = zlib.crc32(f.read(end - start))
    return digest(crcs)


def row(
    name: str, kind: str, urls: list[str], env: dict[str, str], dst: Path, **extra: Any
) -> dict[str, Any]:
    shutil.rmtree(dst, ignore_errors=True)
    cmd = [sys.executable, __file__, "--child", kind, "--dst", str(dst), "--urls", *urls]
    if "span_mib" in extra:
        cmd += ["--span-mib", str(extra["span_mib"])]
    try:
        figures: dict[str, Any] = dict(run_child(cmd, env))
    except SystemExit as failed:  # the row failed: said in the table, the run goes on
        last = str(failed).strip().splitlines()[-3:]
        print(f"  {name}: FAILED {last}", flush=True)
        return {"row": name, "error": " ".join(last)[-300:]}
    figures["row"] = name
    print(f"  {name}: {figures['seconds']:.2f} s, rss {figures['rss'] / MiB:.0f} MiB", flush=True)
    return figures


def rows_for(
    urls: list[str], env: dict[str, str], dst: Path, *, near: bool
) -> list[dict[str, Any]]:
    runai_env = {**env, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"}
    probes = [row(f"probe {s} MiB", "probe", urls, env, dst, span_mib=s) for s in (16, 64)]
    best = min((p for p in probes if "error" not in p), key=lambda r: r["seconds"])
    best["row"] = "probe"
    out = [best]
    if near:
        out.append(row("loaderplug hydrate", "hydrate", urls, env, dst))
        out.append(row("loaderplug one pass", "onepass", urls, env, dst))
    out.append(row("loaderplug stream", "stream", urls, env, dst))
    out.append(row("runai default", "runai", urls, runai_env, dst))
    for n in RUNAI_TUNED:
        tuned = {**runai_env, "RUNAI_STREAMER_CONCURRENCY": str(n)}
        out.append(row(f"runai c{n}", "runai", urls, tuned, dst))
    if near:
        out.append(row("download_file", "download", urls, env, dst))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    compile_loaderplug()
    raw: dict[str, Any] = {"date": datetime.date.today().isoformat(), "cases": []}
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        root = Path(tmp)
        server = SeaweedS3(root / "weed", volume_size_mb=8192, max_volumes=16).start()
        try:
            server.make_bucket(BUCKET)
            env = server.env()
            for gib in args.sizes_gib:
                raw["cases"] += size_cases(server, env, root, gib, args)
        finally:
            server.stop()
    return raw


def size_cases(
    server: SeaweedS3, env: dict[str, str], root: Path, gib: float, args: argparse.Namespace
) -> list[dict[str, Any]]:
    model = root / f"model-{gib}"
    files = write_scale_model(model, int(gib * GiB), shards=8)
    want = expected_digest(files)
    client = server.client()
    urls = []
    for path in files:
        client.upload_file(str(path), BUCKET, f"{model.name}/{path.name}")
        urls.append(f"s3://{BUCKET}/{model.name}/{path.name}")
    size = sum(p.stat().st_size for p in files)
    shutil.rmtree(model)  # the disk holds the bucket and the local copy, not a third
    cases = []
    print(f"{gib} GiB, store on loopback", flush=True)
    near = rows_for(urls, env, root / "dst", near=True)
    cases.append({"gib": gib, "bytes": size, "link": "loopback", "rows": near, "want": want})
    if gib in args.proxy_gib:
        proxy = ObjectProxy(
            server.endpoint.removeprefix("http://"),
            bytes_per_s=args.link_mib_s * MiB,
            latency_s=0.005,
        ).start()
        try:
            print(f"{gib} GiB, behind the proxy", flush=True)
            far = rows_for(
                urls, {**env, "AWS_ENDPOINT_URL": proxy.endpoint}, root / "dst", near=False
            )
        finally:
            proxy.stop()
        link = f"{args.link_mib_s} MiB/s per connection, 5 ms"
        cases.append({"gib": gib, "bytes": size, "link": link, "rows": far, "want": want})
    for case in cases:
        for r in case["rows"]:
            if "error" in r:
                continue
            r["tensors_equal"] = r["digest"] == want if r["digest"] else None
            r["mib_s"] = size / MiB / r["seconds"]
            r["cpu_s_per_gib"] = r["cpu_s"] / (size / GiB)
    return cases


def table(raw: dict[str, Any]) -> str:
    lines = [
        "| model | link | row | s | MiB/s | x probe | first tensor s | peak RSS MiB "
        "| CPU s/GiB | tensors equal |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for case in raw["cases"]:
        probe = next(r for r in case["rows"] if r["row"] == "probe")
        for r in case["rows"]:
            if "error" in r:
                lines.append(
                    f"| {case['bytes'] / GiB:.1f} GiB | {case['link']} | {r['row']} "
                    f"| failed: {r['error']} | | | | | | |"
                )
                continue
            first = f"{r['first_tensor_s']:.2f}" if r["first_tensor_s"] else "-"
            equal = {True: "yes", False: "**NO**", None: "-"}[r["tensors_equal"]]
            lines.append(
                f"| {case['bytes'] / GiB:.1f} GiB | {case['link']} | {r['row']} "
                f"| {r['seconds']:.2f} "
                f"| {r['mib_s']:.0f} | {r['mib_s'] / probe['mib_s']:.2f} | {first} "
                f"| {r['rss'] / MiB:.0f} | {r['cpu_s_per_gib']:.2f} | {equal} |"
            )
    return "\n".join(lines)


def ratios(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's ratios, per case, from the same run."""
    out = []
    for case in raw["cases"]:
        by = {r["row"]: r for r in case["rows"] if "error" not in r}
        tuned = min(by[f"runai c{n}"]["seconds"] for n in RUNAI_TUNED if f"runai c{n}" in by)
        entry = {
            "case": f"{case['bytes'] / GiB:.1f} GiB, {case['link']}",
            "stream_vs_runai_default": by["runai default"]["seconds"]
            / by["loaderplug stream"]["seconds"],
            "stream_vs_runai_tuned": tuned / by["loaderplug stream"]["seconds"],
        }
        if "loaderplug hydrate" in by:
            entry["hydrate_vs_probe"] = by["probe"]["seconds"] / by["loaderplug hydrate"]["seconds"]
            entry["stream_peak_rss_mib"] = by["loaderplug stream"]["rss"] / MiB
        out.append(entry)
    return out


def draw(raw: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = raw["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases, strict=True):
        done = [r for r in case["rows"] if "error" not in r]
        names = [r["row"] for r in done]
        rates = [r["mib_s"] for r in done]
        colors = [
            "#888"
            if n == "probe"
            else "#1f77b4"
            if n.startswith("loaderplug")
            else "#d62728"
            if n.startswith("runai")
            else "#aaa"
            for n in names
        ]
        ax.barh(names[::-1], rates[::-1], color=colors[::-1])
        ax.set_xlabel("MiB/s (model bytes / time to the last tensor or byte)")
        ax.set_title(f"{case['bytes'] / GiB:.1f} GiB, {case['link']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "objectstore.png", dpi=110)


def _color(row: str) -> str:
    if row == "probe":
        return "#888888"
    if row.startswith("loaderplug"):
        return "#1f77b4"
    return "#d62728" if row.startswith("runai") else "#bbbbbb"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child")
    parser.add_argument("--urls", nargs="*")
    parser.add_argument("--dst")
    parser.add_argument("--span-mib", type=int, default=16)
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[2, 8])
    parser.add_argument("--proxy-gib", type=float, nargs="*", default=[2])
    parser.add_argument("--link-mib-s", type=int, default=100)
    parser.add_argument("--tmp", default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    raw = run(args)
    raw["ratios"] = ratios(raw)
    header = (
        f"# A model in a bucket\n\nLocal SeaweedFS (weed server -s3), models in 8 shards; "
        f"each row a child process; {raw['date']}, 2 cores. See "
        f"benchmarks/objectstore_bench.py.\n\n"
    )
    ratio_lines = "\n".join(
        f"- {r['case']}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k != "case")
        for r in raw["ratios"]
    )
    write_results(args.out, "objectstore", header, table(raw) + "\n\n" + ratio_lines, raw)
    draw(raw, args.out)


if __name__ == "__main__":
    main()
