"""A worker's cold start: hydrate the model from the volume mirror, then load it.

    LOADERPLUG_MIRROR=/mnt/volume python examples/hydrate_worker.py acme/llama /local/models

The mirror holds models under <volume>/models/<name> (filled by `loaderplug sync`).
Several workers on one host may run this at once: they share one copy through the
destination's lock, and a worker that finds the model already local copies nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import loaderplug


def main(name: str, local_root: str) -> Path:
    mirror = loaderplug.find_mirror("folder", name)
    if mirror is None:
        raise SystemExit(f"{name} is not on the mirror; set LOADERPLUG_MIRROR or sync it first")
    local = Path(local_root) / name
    try:
        report = loaderplug.hydrate(mirror, local)
    except loaderplug.TransferFailed as exc:
        # Files that landed are complete; the failed ones are listed with their reasons.
        raise SystemExit(exc.report.summary()) from exc
    print(report.summary())
    return local  # hand this folder to your loader (transformers, vLLM, ...)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
