"""A projection on paper from benchmarks/results/multihost.json to a large deployment:
8 hosts x 8 GPUs loading a 400 GiB model in one pass, each host's mount of the volume at
the rate measured on a real network volume (1.4 GiB/s), links of 25 to 400 Gbit/s used
as efficiently as the simulated links were here (the exchange's received bytes per
second of gather, over the link's rate), and the local disk writing at 4 GiB/s.

Per host, side by side: max(model / volume, model / disk). Split between H hosts:
max(model / H / volume, model x (H-1) / H / exchange, model / disk), the reads, the
exchange and the writes overlapping as they did here. With a volume whose rate is
shared by every host (``--shared-volume``), side by side divides it by H.

    python benchmarks/multihost_projection.py   # appends to results/multihost.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1024**3
MARK = "<!-- projection -->"


def efficiency(raw: dict[str, Any]) -> dict[float, float]:
    """Per link rate: the exchange's received bytes per second of gather over the
    link's bytes per second, the median over the split cells' ranks."""
    by_link: dict[float, list[float]] = {}
    for cell in raw["cells"]:
        if not all(cell["split"]):
            continue
        link = cell["link_gbit"] * 1e9 / 8
        for received, seconds, _rounds in cell["exchange"]:
            if received and seconds:
                by_link.setdefault(cell["link_gbit"], []).append(received / seconds / link)
    return {link: statistics.median(values) for link, values in sorted(by_link.items())}


def project(
    used: float, hosts: int, model_gib: float, volume: float, disk: float, shared: bool
) -> str:
    lines = [
        "| link Gbit/s | exchange GiB/s a host | side by side s | split s | ratio | bound by "
        "| auto splits |",
        "|---|---|---|---|---|---|---|",
    ]
    alone_volume = volume / hosts if shared else volume
    alone = max(model_gib / alone_volume, model_gib / disk)
    for link in (25, 100, 200, 400):
        exchange = link * 1e9 / 8 / GIB * used
        parts = {
            "volume": model_gib / hosts / volume,
            "exchange": model_gib * (hosts - 1) / hosts / exchange,
            "local disk": model_gib / disk,
        }
        split = max(parts.values())
        bound = max(parts, key=lambda k: parts[k])
        # The rule of LOADERPLUG_HOST_SPLIT=auto: the exchange for its (H-1)/H against
        # the mirror for all of it (otherwise each host reads alone: 1.00).
        auto = exchange * hosts / (hosts - 1) > alone_volume
        lines.append(
            f"| {link} | {exchange:.1f} | {alone:.0f} | {split:.0f} | **{split / alone:.2f}** "
            f"| {bound} | {'yes' if auto else 'no (1.00)'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--model-gib", type=float, default=400)
    parser.add_argument("--volume-gib-s", type=float, default=1.4)
    parser.add_argument("--disk-gib-s", type=float, default=4.0)
    parser.add_argument("--name", default="multihost")
    args = parser.parse_args()
    raw = json.loads((RESULTS / f"{args.name}.json").read_text())
    used = efficiency(raw)
    worst = min(used.values())
    shown = ", ".join(f"{link:g} Gbit/s {value:.0%}" for link, value in used.items())
    text = (
        f"\n{MARK}\n## Projection: {args.hosts} hosts x 8 GPUs, {args.model_gib:g} GiB\n\n"
        f"On paper (`python benchmarks/multihost_projection.py`): each host's mount at "
        f"{args.volume_gib_s:g} GiB/s, local disk {args.disk_gib_s:g} GiB/s, each link used at "
        f"{worst:.0%} of its rate (the worst measured here: {shown}). The 8 ranks of a "
        "host then map its copy (page cache), as measured on one host. The volume's rate "
        "per host:\n\n"
        + project(worst, args.hosts, args.model_gib, args.volume_gib_s, args.disk_gib_s, False)
        + f"\n\nA volume of {args.volume_gib_s:g} GiB/s in all, shared by the hosts:\n\n"
        + project(worst, args.hosts, args.model_gib, args.volume_gib_s, args.disk_gib_s, True)
        + "\n"
    )
    md = RESULTS / f"{args.name}.md"
    kept = md.read_text().split(f"\n{MARK}\n")[0]
    md.write_text(kept.rstrip("\n") + "\n" + text)
    print(text)


if __name__ == "__main__":
    main()
