"""Object store clients compared on one server: which one loaderplug's ranged reads use.

A local SeaweedFS (``weed server -s3``) holds one object of ``--object-mib``; each
client reads it whole by ranged GETs of 8 and 64 MiB from 16 threads, landing every
range in a buffer of the reader's own (as the engine's readers do), three rounds each,
best round kept. Figures: MiB/s and the client process's CPU seconds per GiB (the
server's CPU is not counted; it is the same for every client).

Clients: obstore (``get_range``, the bytes copied into the buffer; and ``get`` with its
body streamed into the buffer, as loaderplug reads a span; both copied as loaderplug
copies, without the GIL), boto3 (``get_object`` with
``Range``, ``Body.read()`` copied; and ``Body.readinto`` straight into the buffer), and
urllib3 with botocore's SigV4 signer, ``readinto`` straight into the buffer.

    python benchmarks/objectstore_clients.py [--object-mib 1024]

Writes benchmarks/results/objectstore_clients.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from common import write_results  # noqa: E402

from loaderplug.storage.object_store import STREAM_CHUNK, copy_into  # noqa: E402
from loaderplug.testing.object_server import SeaweedS3  # noqa: E402
from loaderplug.units import GiB, MiB  # noqa: E402

BUCKET, KEY = "bench", "object.bin"
THREADS = 16
Reader = Callable[[int, memoryview], None]  # offset, buffer to fill


def obstore_readers(server: SeaweedS3) -> dict[str, Reader]:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        config={"endpoint": server.endpoint},
        client_options={"allow_http": True, "pool_max_idle_per_host": "64"},
    )

    def get_range(offset: int, buf: memoryview) -> None:
        data = obstore.get_range(store, KEY, start=offset, length=len(buf))
        copy_into(buf, memoryview(data).cast("B"))

    def streamed(offset: int, buf: memoryview) -> None:
        result = obstore.get(store, KEY, options={"range": (offset, offset + len(buf))})
        done = 0
        for chunk in result.stream(min_chunk_size=STREAM_CHUNK):
            view = memoryview(chunk).cast("B")
            copy_into(buf[done : done + len(view)], view)
            done += len(view)

    return {"obstore get_range": get_range, "obstore get, body streamed": streamed}


def boto3_readers(server: SeaweedS3) -> dict[str, Reader]:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        config=Config(max_pool_connections=64, s3={"addressing_style": "path"}),
    )

    def get(offset: int, buf: memoryview) -> Any:
        rng = f"bytes={offset}-{offset + len(buf) - 1}"
        return client.get_object(Bucket=BUCKET, Key=KEY, Range=rng)["Body"]

    def read(offset: int, buf: memoryview) -> None:
        buf[:] = get(offset, buf).read()

    def readinto(offset: int, buf: memoryview) -> None:
        raw = get(offset, buf)._raw_stream
        done = 0
        while done < len(buf):
            n = raw.readinto(buf[done:])
            if not n:
                raise OSError("short body")
            done += n

    return {"boto3 get_object read()": read, "boto3 get_object readinto": readinto}


def urllib3_readers(server: SeaweedS3) -> dict[str, Reader]:
    import urllib3
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    pool = urllib3.PoolManager(maxsize=64)
    credentials = Credentials(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"])
    url = f"{server.endpoint}/{BUCKET}/{KEY}"

    def readinto(offset: int, buf: memoryview) -> None:
        request = AWSRequest(
            "GET", url, headers={"Range": f"bytes={offset}-{offset + len(buf) - 1}"}
        )
        S3SigV4Auth(credentials, "s3", "us-east-1").add_auth(request)
        answer = pool.request("GET", url, headers=dict(request.headers), preload_content=False)
        done = 0
        while done < len(buf):
            n = answer.readinto(buf[done:])
            if not n:
                raise OSError("short body")
            done += n
        answer.release_conn()

    return {"urllib3 + SigV4, readinto": readinto}


def measure(reader: Reader, size: int, span: int) -> dict[str, float]:
    """Read ``size`` bytes by ``span``-byte ranges from THREADS threads."""
    offsets = list(range(0, size, span))
    lock = threading.Lock()
    buffers = [bytearray(span) for _ in range(THREADS)]

    def work(index: int) -> None:
        buf = memoryview(buffers[index])
        while True:
            with lock:
                if not offsets:
                    return
                offset = offsets.pop()
            reader(offset, buf[: min(span, size - offset)])

    cpu, wall = time.process_time(), time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"mib_s": size / MiB / wall, "cpu_s_per_gib": cpu / (size / GiB), "seconds": wall}


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = args.object_mib * MiB
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        server = SeaweedS3(Path(tmp) / "weed", volume_size_mb=4096).start()
        try:
            os.environ.update(server.env())
            server.make_bucket(BUCKET)
            data = Path(tmp) / "object.bin"
            with open(data, "wb") as f:
                for _ in range(args.object_mib):
                    f.write(os.urandom(MiB))
            server.client().upload_file(str(data), BUCKET, KEY)
            readers = {
                **obstore_readers(server),
                **boto3_readers(server),
                **urllib3_readers(server),
            }
            rows = []
            for span_mib in (8, 64):
                for name, reader in readers.items():
                    best = max(
                        (measure(reader, size, span_mib * MiB) for _ in range(3)),
                        key=lambda r: r["mib_s"],
                    )
                    rows.append({"client": name, "span_mib": span_mib, **best})
                    print(rows[-1], flush=True)
        finally:
            server.stop()
    return {
        "date": datetime.date.today().isoformat(),
        "object_mib": args.object_mib,
        "threads": THREADS,
        "rows": rows,
    }


def table(raw: dict[str, Any]) -> str:
    lines = [
        "| client | range | MiB/s | CPU s / GiB (client) |",
        "|---|---:|---:|---:|",
    ]
    for r in raw["rows"]:
        lines.append(
            f"| {r['client']} | {r['span_mib']} MiB | {r['mib_s']:.0f} | {r['cpu_s_per_gib']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--object-mib", type=int, default=1024)
    parser.add_argument("--tmp", default=None)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    raw = run(args)
    header = (
        f"# Object store clients\n\nOne {raw['object_mib']} MiB object on a local SeaweedFS "
        f"(weed server -s3), read whole by ranged GETs from {raw['threads']} threads into "
        f"buffers of their own; best of 3 rounds; {raw['date']}, 2 cores.\n\n"
    )
    write_results(args.out, "objectstore_clients", header, table(raw), raw)


if __name__ == "__main__":
    main()
