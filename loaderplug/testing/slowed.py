"""``loaderplug`` in a subprocess, every read slowed down, so a test can stop it mid-copy
(see slow_hydrate.py); with no delay, the plain command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HELPER = Path(__file__).parent / "slow_hydrate.py"
REPO = Path(__file__).resolve().parent.parent.parent


def start(
    args: list[str], delay_s: float = 0.0, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """Run ``loaderplug ARGS`` with only ``env`` (and what any run needs) set."""
    launcher = [str(HELPER), str(delay_s)] if delay_s else ["-m", "loaderplug"]
    return subprocess.Popen(
        [sys.executable, *launcher, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "LOADERPLUG_PROGRESS": "0",
            # Kill trials compare runs: no measured IO policy may change between them.
            "LOADERPLUG_IO_PROBE": "0",
            **(env or {}),
        },
    )
