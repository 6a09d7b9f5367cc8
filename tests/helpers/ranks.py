"""Ranks of a gloo group in real processes (``rank_load.py`` each), and what they should
have received."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

HELPER = Path(__file__).parent / "rank_load.py"
REPO = Path(__file__).resolve().parents[2]


# What every rank of a test runs with: small spans, so small models have many.
RANK_ENV = {
    "PATH": "/usr/bin:/bin",
    "PYTHONPATH": str(REPO),
    "LOADERPLUG_PROGRESS": "0",
    "LOADERPLUG_SPAN_BYTES": "256K",
    "LOADERPLUG_SPLIT_THRESHOLD_BYTES": "512K",
    "LOADERPLUG_READERS": "4",
    "LOADERPLUG_FSYNC": "0",
    "LOADERPLUG_IO_PROBE": "0",  # as in every test (see conftest)
}


def expected(files: list[Path]) -> dict[str, list[Any]]:
    import torch
    from safetensors.torch import load_file

    want = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            want[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), zlib.crc32(raw)]
    return want


def run_ranks(
    tmp_path: Path,
    files: list[Path] | list[str],
    world: int,
    env: dict[str, str] | None = None,
    per_rank: dict[int, dict[str, str]] | None = None,
    timeout_s: float = 180,
) -> tuple[list[dict[str, Any]], float]:
    init = tmp_path / f"init-{time.monotonic_ns()}"
    base = {
        **RANK_ENV,
        # The test's files stand for loaderplug's own local copies, which ranks may map
        # (a user's folder is broadcast: tests/test_ranks_faults.py).
        "LOADERPLUG_LOCAL_COPIES": str(tmp_path),
        **(env or {}),
    }
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPER), str(init), str(r), str(world), *map(str, files)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**base, **(per_rank or {}).get(r, {})},
        )
        for r in range(world)
    ]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout_s)
        said = json.loads(out) if out.strip() else {"exit": proc.returncode, "stderr": err}
        said["exited_at"] = time.time()  # when this rank was seen gone (the ones before too)
        outs.append(said)
    return outs, time.monotonic() - started


def died_at(out: dict[str, Any]) -> float | None:
    """When a rank killed by RANK_DIE_AT_S died (unix time), from its stderr."""
    found = re.search(r"dying at ([0-9.]+)", out.get("stderr", ""))
    return float(found.group(1)) if found else None
