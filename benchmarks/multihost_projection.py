"""A projection on paper from benchmarks/results/multihost.json to a large deployment:
8 hosts x 8 GPUs loading a 400 GiB model in one pass, each host's mount of the volume at
the rate measured on a real network volume (1.4 GiB/s), links of 25 to 400 Gbit/s used
as efficiently as the simulated links were here (the exchange's received bytes per
second of gather, over the link's rate), and the local disk writing at 4 GiB/s.

Per host, side by side: max(model / volume, model / disk). Split between H hosts:
max(model / H / volume, model x (H-1) / H / exchange, model / disk), the reads, the
exchange and the writes overlapping as they did here. With a volume whose rate is
shared by every host, side by side reads at volume / H, and the split's reads take
model / volume in all (the model is read from it once). Links are used as measured;
for faster links, whose use was not measured, the part of the link the exchange must
reach for the split to pay.

    python benchmarks/multihost_projection.py   # appends to results/multihost.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Deployment:
    """What the projection is of: ``hosts`` loading ``model_gib`` each, every host's
    mount at ``volume`` GiB/s (``shared``: the volume's rate in all, shared by the
    hosts), its local disk writing at ``disk`` GiB/s."""

    hosts: int
    model_gib: float
    volume: float
    disk: float
    shared: bool

    def side_by_side_s(self) -> float:
        """Every host reading the whole model from the volume (at its share of the rate,
        if shared) and writing it to its disk."""
        per_host = self.volume / self.hosts if self.shared else self.volume
        return max(self.model_gib / per_host, self.model_gib / self.disk)

    def fixed_parts_s(self) -> dict[str, float]:
        """What the split cannot go below whatever the links: the volume serving the
        model once in all (each host 1/H of it; a shared volume serves all of it at its
        one rate) and each host writing the whole copy."""
        volume_s = self.model_gib / self.volume
        return {
            "volume": volume_s if self.shared else volume_s / self.hosts,
            "local disk": self.model_gib / self.disk,
        }

    def exchange_gib(self) -> float:
        """What each host receives over its link: (H-1)/H of the model."""
        return self.model_gib * (self.hosts - 1) / self.hosts


def measured_rows(deployment: Deployment, used: dict[float, float]) -> list[str]:
    """Rows for the links measured here, each at the part of its rate it reached."""
    alone = deployment.side_by_side_s()
    rows = []
    for link, efficiency in used.items():
        exchange = link * 1e9 / 8 / GIB * efficiency
        parts = {**deployment.fixed_parts_s(), "exchange": deployment.exchange_gib() / exchange}
        split = max(parts.values())
        bound = max(parts, key=lambda k: parts[k])
        # The rule of LOADERPLUG_HOST_SPLIT=auto: the exchange for its (H-1)/H against
        # the mirror for all of it (otherwise each host reads alone: 1.00).
        per_host = deployment.volume / deployment.hosts if deployment.shared else deployment.volume
        auto = exchange * deployment.hosts / (deployment.hosts - 1) > per_host
        rows.append(
            f"| {link:g} | {efficiency:.0%} (measured) | {exchange:.2f} | {alone:.0f} | "
            f"{split:.0f} | **{split / alone:.2f}** | {bound} | {'yes' if auto else 'no (1.00)'} |"
        )
    return rows


def unmeasured_rows(deployment: Deployment, links: tuple[float, ...]) -> list[str]:
    """Rows for faster links, whose efficiency was not measured: the part of the link
    the exchange must reach for the split to pay, and to be bound by the volume or the
    disk instead (nothing is assumed of the link)."""
    alone = deployment.side_by_side_s()
    fixed = deployment.fixed_parts_s()
    rows = []
    for link in links:
        link_gib = link * 1e9 / 8 / GIB
        # The exchange at the whole link is a bound too: on a slow link it is above the
        # volume's and the disk's, and the split goes no lower than the largest of them.
        floor = max(*fixed.values(), deployment.exchange_gib() / link_gib)
        pays = deployment.exchange_gib() / (alone * link_gib)
        bound = deployment.exchange_gib() / (max(fixed.values()) * link_gib)
        best = "never pays" if floor >= alone else f"> {pays:.1%} of the link"
        limit = max(fixed, key=lambda k: fixed[k])
        bound_by = (
            f"{limit} at >= {bound:.1%} of the link" if bound <= 1 else "the exchange at any use"
        )
        rows.append(
            f"| {link:g} | not measured | | {alone:.0f} | >= {floor:.0f} | "
            f">= {floor / alone:.2f} | {bound_by} | {best} |"
        )
    return rows


def project(deployment: Deployment, used: dict[float, float]) -> str:
    lines = [
        "| link Gbit/s | link used | exchange GiB/s a host | side by side s | split s | "
        "ratio | bound by | split pays |",
        "|---|---|---|---|---|---|---|---|",
        *measured_rows(deployment, used),
        *unmeasured_rows(deployment, (25, 100, 200, 400)),
    ]
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
    shown = ", ".join(f"{link:g} Gbit/s {value:.0%}" for link, value in used.items())

    def deployment(shared: bool) -> Deployment:
        return Deployment(args.hosts, args.model_gib, args.volume_gib_s, args.disk_gib_s, shared)

    text = (
        f"\n{MARK}\n## Projection: {args.hosts} hosts x 8 GPUs, {args.model_gib:g} GiB\n\n"
        f"On paper (`python benchmarks/multihost_projection.py`): each host's mount at "
        f"{args.volume_gib_s:g} GiB/s, local disk {args.disk_gib_s:g} GiB/s; each link used "
        f"as measured here ({shown}: the hosts' processes share two cores). Faster links "
        "were not measured: for those the table says the part of the link the exchange "
        "must reach for the split to pay, and the floor the volume or the disk sets "
        "whatever the link. The 8 ranks of a host then map its copy (page cache), as "
        "measured on one host. The volume's rate per host:\n\n"
        + project(deployment(False), used)
        + f"\n\nA volume of {args.volume_gib_s:g} GiB/s in all, shared by the hosts "
        "(the model read from it once in all takes model / rate, whatever the hosts):\n\n"
        + project(deployment(True), used)
        + "\n"
    )
    md = RESULTS / f"{args.name}.md"
    kept = md.read_text().split(f"\n{MARK}\n")[0]
    md.write_text(kept.rstrip("\n") + "\n" + text)
    print(text)


if __name__ == "__main__":
    main()
