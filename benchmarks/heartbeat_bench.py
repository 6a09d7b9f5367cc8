"""The store traffic of the ranks' heartbeats at 8, 64 and 512 simulated ranks.

Every simulated rank is loaderplug's own :class:`~loaderplug.tensors.ranks.heartbeats.Heartbeats`
on a client connection of its own to one real ``torch.distributed.TCPStore`` (the store
torchrun serves on rank 0's host), beating every ``BEAT_S`` from a pool of threads, for
``--seconds`` per cell. Beside it, the watch as it was before: every rank counting its
own key up and reading every other rank's, one operation per key. Each cell says the
operations the store was asked per second, the operations a rank asked per beat, the
beats that came late (a beat is due every ``BEAT_S``; a late one is how a store too
busy to answer looks to a rank), and the deaths the watch reported (every rank beat
throughout: any death is a false one).

    python benchmarks/heartbeat_bench.py            # writes results/heartbeat.{md,json,png}
    python benchmarks/heartbeat_bench.py --quick    # 3 s a cell
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_results
from loaderplug.tensors.ranks.heartbeats import BEAT_S, SILENT_S, Heartbeats, Peer

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = (8, 64, 512)
THREADS = 16


class Counted:
    """A store client that counts the operations asked of it."""

    def __init__(self, store: Any) -> None:
        self.store, self.operations = store, 0

    def __getattr__(self, name: str) -> Any:
        operation = getattr(self.store, name)

        def counted(*args: Any) -> Any:
            self.operations += 1
            return operation(*args)

        return counted


class EveryRankReadsEveryRank:
    """The watch before: a rank counts its key up and reads every peer's, a key an
    operation, and takes a peer whose count stood still for SILENT_S for dead."""

    def __init__(self, store: Any, rank: int, peers: Sequence[Peer]) -> None:
        self._store, self._rank = store, rank
        self._last = {p: (-1, time.monotonic()) for p in peers}

    def beat(self) -> list[Peer]:
        now = time.monotonic()
        self._store.add(str(self._rank), 1)
        counts = {peer: self._store.add(str(peer.rank), 0) for peer in self._last}
        silent = []
        for peer, count in counts.items():
            last, since = self._last[peer]
            if count != last:
                self._last[peer] = (count, now)
            elif count > 0 and now - since >= SILENT_S:
                silent.append(peer)
        for peer in silent:
            del self._last[peer]
        return silent


WATCHES: dict[str, Callable[[Any, int, Sequence[Peer]], Any]] = {
    "loaderplug": Heartbeats,
    "every rank reads every rank": EveryRankReadsEveryRank,
}


def run_cell(port: int, watch: str, size: int, seconds: float) -> dict[str, Any]:
    """``size`` ranks of ``watch`` beating for ``seconds`` on the store at ``port``."""
    from torch.distributed import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=60)
    clients = [
        Counted(PrefixStore(f"{watch}/{size}/", TCPStore("127.0.0.1", port, timeout=timeout)))
        for _ in range(size)
    ]
    ranks = [
        WATCHES[watch](clients[r], r, [Peer(p, None) for p in range(size) if p != r])
        for r in range(size)
    ]
    for rank in ranks:  # the first beat makes the keys: not counted
        rank.beat()
    before = sum(c.operations for c in clients)
    beats, late, deaths = [0] * size, [0] * size, [0] * size
    stop = time.monotonic() + seconds
    started = time.monotonic()

    def beat_share(first: int) -> None:
        due = [time.monotonic()] * size
        while time.monotonic() < stop:
            for r in range(first, size, THREADS):
                if time.monotonic() < due[r]:
                    continue
                if time.monotonic() - due[r] > BEAT_S:  # due a whole beat ago
                    late[r] += 1
                deaths[r] += len(ranks[r].beat())
                beats[r] += 1
                due[r] += BEAT_S
            time.sleep(0.005)

    threads = [threading.Thread(target=beat_share, args=(t,)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.monotonic() - started
    operations = sum(c.operations for c in clients) - before
    return {
        "watch": watch,
        "ranks": size,
        "seconds": took,
        "operations_per_s": operations / took,
        "operations_per_rank_beat": operations / max(sum(beats), 1),
        "asked_per_s": size / BEAT_S * _per_beat(watch, size),
        "beats": sum(beats),
        "beats_due": int(size * took / BEAT_S),
        "late_beats": sum(late),
        "false_deaths": sum(deaths),
    }


def _per_beat(watch: str, size: int) -> int:
    """The operations one rank's beat asks of the store, by design."""
    return 2 if watch == "loaderplug" else size


def table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | watch | store ops/s asked | store ops/s served | ops a rank a beat "
        "| beats served / due | late beats | false deaths |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['ranks']} | {c['watch']} | {c['asked_per_s']:,.0f} | "
            f"{c['operations_per_s']:,.0f} | {c['operations_per_rank_beat']:.1f} | "
            f"{c['beats']:,} / {c['beats_due']:,} | {c['late_beats']:,} | {c['false_deaths']} |"
        )
    return "\n".join(lines)


def draw(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for watch, marker in zip(WATCHES, "os", strict=True):
        mine = [c for c in cells if c["watch"] == watch]
        sizes = [c["ranks"] for c in mine]
        ax.plot(sizes, [c["asked_per_s"] for c in mine], marker=marker, ls="--",
                label=f"{watch}: asked")  # fmt: skip
        ax.plot(sizes, [c["operations_per_s"] for c in mine], marker=marker,
                label=f"{watch}: served")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("store operations per second")
    ax.set_title("Heartbeat store traffic (one TCPStore, beats every 0.25 s)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="3 s a cell")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    seconds = 3.0 if args.quick else args.seconds
    from torch.distributed import TCPStore

    server = TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False
    )
    cells = [run_cell(server.port, watch, size, seconds) for size in SIZES for watch in WATCHES]
    load = os.getloadavg()[0]
    header = (
        "# Heartbeat store traffic\n\n"
        f"Simulated ranks beating every {BEAT_S:g} s on one TCPStore for {seconds:g} s a "
        f"cell, {THREADS} threads, 2 cores (load average {load:.1f} at the end). "
        "Every rank beat throughout: a death reported is a false one. Command: "
        f"`python benchmarks/heartbeat_bench.py{' --quick' if args.quick else ''}`.\n\n"
    )
    write_results(args.out, "heartbeat", header, table(cells), {"cells": cells})
    draw(cells, args.out / "heartbeat.png")


if __name__ == "__main__":
    main()
