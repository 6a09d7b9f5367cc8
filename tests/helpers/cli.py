"""The ``loaderplug`` command run as a user runs it: a process of its own, this checkout
on its path, a bare environment (no measuring probe), under a time bound."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LOADERPLUG_IO_PROBE": "0"}


def run_cli(
    *args: str, timeout: float = 120, preexec_fn: Callable[[], None] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loaderplug", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=ENV,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )
