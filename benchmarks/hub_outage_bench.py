"""A second worker's ``from_pretrained`` by repo id while the Hub is up, hung, failing or
gone, with the mirror holding the model: under ``loaderplug run`` and stock.

    python benchmarks/hub_outage_bench.py [--out benchmarks/results] [--cap-s 90]

The first worker (under ``loaderplug run``, the Hub up) downloads a tiny Llama and fills
the mirror. Then, for each state of the test Hub (up; hung: every request accepted and
never answered; every request answered 500, or 429; stopped: connections refused), a
fresh worker process with an empty cache loads the model and its tokenizer, once under
``loaderplug run`` (``LOADERPLUG_HUB_TIMEOUT_S`` at its default) and once as stock
transformers, each cut off at ``--cap-s``. The table gives each run's seconds (process
start to exit, transformers' import included), whether it loaded, and the Hub requests
it made.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import write_results  # benchmarks/ is on sys.path when this runs as a script

from loaderplug.testing.hub import HubServer, client_env
from loaderplug.testing.tiny_llama import write_tiny_llama

REPO = "acme/llama"
WORKER = (
    "import transformers\n"
    f"transformers.AutoModelForCausalLM.from_pretrained({REPO!r})\n"
    f"transformers.AutoTokenizer.from_pretrained({REPO!r})\n"
    "print('loaded')\n"
)
STATES = ("up", "hang", "500", "429", "stopped")


def worker(hub: HubServer, home: Path, volume: Path, wrapped: bool, cap_s: float) -> dict[str, Any]:
    command = [sys.executable, "-c", WORKER]
    env = {**os.environ, **client_env(hub.endpoint, home), "LOADERPLUG_MIRROR": str(volume),
           "LOADERPLUG_PROGRESS": "0"}  # fmt: skip
    hub.reset_counts()
    started = time.perf_counter()
    try:
        done = subprocess.run(
            ["loaderplug", "run", *command] if wrapped else command,
            env=env,
            capture_output=True,
            text=True,
            timeout=cap_s,
        )
        loaded = done.returncode == 0 and "loaded" in done.stdout
        outcome = "loaded" if loaded else f"failed ({done.returncode})"
    except subprocess.TimeoutExpired:
        outcome = f"still waiting at {cap_s:.0f} s"
    return {"seconds": time.perf_counter() - started, "outcome": outcome,
            "requests": len(hub.requests), "file_requests": hub.file_requests()}  # fmt: skip


def run(cap_s: float) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_tiny_llama(root / "llama", shards=2)
        files = {p.name: p.read_bytes() for p in (root / "llama").iterdir()}
        volume = root / "volume"
        volume.mkdir()
        for state in STATES:
            with HubServer() as hub:
                hub.add_repo(REPO, files)
                worker(hub, root / f"first-{state}", volume, True, cap_s)  # fills the mirror
                if state == "stopped":
                    hub.stop()
                elif state != "up":
                    hub.failing = state
                for wrapped in (True, False):
                    home = root / f"{state}-{wrapped}"
                    results[f"{state}/{'loaderplug run' if wrapped else 'stock'}"] = worker(
                        hub, home, volume, wrapped, cap_s
                    )
                    print(state, wrapped, results, flush=True)
    return results


def table(results: dict[str, Any]) -> str:
    up = results["up/loaderplug run"]["seconds"]
    rows = [
        "| Hub | worker | s | x Hub up (loaderplug run) | outcome | Hub requests (files) |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        state, who = key.split("/")
        rows.append(
            f"| {state} | {who} | {r['seconds']:.1f} | {r['seconds'] / up:.2f} | "
            f"{r['outcome']} | {r['requests']} ({r['file_requests']}) |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--cap-s", type=float, default=90.0)
    parser.add_argument("--quick", action="store_true", help="a 40 s cap")
    args = parser.parse_args()
    results = run(40.0 if args.quick else args.cap_s)
    header = (
        "# A second worker while the Hub is up, hung, failing or gone\n\n"
        "The mirror holds the model (a first worker filled it); a fresh worker with an empty "
        "cache runs transformers' `from_pretrained` of the model and its tokenizer by repo "
        "id, under `loaderplug run` (LOADERPLUG_HUB_TIMEOUT_S=10, the default) and stock "
        "(which knows no mirror: the Hub is its only source). Seconds from process start to "
        "exit (transformers' import included); `x Hub up` is over the Hub-up time under "
        "`loaderplug run`.\n\n"
    )
    write_results(args.out, "hub_outage", header, table(results), results)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
