"""What ``loaderplug run`` costs a Python process that never imports huggingface_hub:
``python -c pass`` started with and without the bootstrap folder on ``PYTHONPATH``,
alternating, the median of many starts.

    python benchmarks/run_startup_bench.py [--starts 200] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import write_results  # benchmarks/ is on sys.path when this runs as a script

from loaderplug.cli.run import BOOTSTRAP


def start(pythonpath: str) -> float:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "LOADERPLUG_MIRROR": "/tmp"}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--starts", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="40 starts")
    args = parser.parse_args()
    starts = 40 if args.quick else args.starts
    start(str(BOOTSTRAP))  # its bytecode written once, as an installed package has it
    without, with_ = [], []
    for _ in range(starts):
        without.append(start("/nonexistent"))
        with_.append(start(str(BOOTSTRAP)))
    a, b = statistics.median(without) * 1e3, statistics.median(with_) * 1e3
    table = (
        "| python -c pass | median ms | p90 ms |\n|---|---|---|\n"
        f"| plain | {a:.1f} | {statistics.quantiles(without, n=10)[-1] * 1e3:.1f} |\n"
        f"| under loaderplug run | {b:.1f} | {statistics.quantiles(with_, n=10)[-1] * 1e3:.1f} |\n"
        f"| difference | {b - a:.1f} | |"
    )
    header = (
        "# What `loaderplug run` costs a process that never imports huggingface_hub\n\n"
        f"{starts} starts of each, alternating; `{sys.executable}` started directly.\n\n"
    )
    write_results(args.out, "run_startup", header, table, {"without_ms": a, "with_ms": b})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
