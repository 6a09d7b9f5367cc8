"""A worker that gets its model through huggingface_hub, with loaderplug in the path.

    LOADERPLUG_MIRROR=/mnt/volume python examples/hf_worker.py org/model [--allow '*.json']

The first worker on a fleet downloads from the Hub as usual, and the download is copied
to <volume>/hub/ in the Hub's cache layout. Every later worker hydrates the model from
the volume at volume speed, without a request to the Hub, and its local cache then
works offline (HF_HUB_OFFLINE=1). Code that calls snapshot_download itself (transformers,
diffusers, vLLM) goes through loaderplug as well once install() has run.
"""

from __future__ import annotations

import argparse
import time

import huggingface_hub

from loaderplug.integrations import huggingface_hub as lp_hub


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repo_id")
    parser.add_argument("--revision", default=None)
    parser.add_argument("--allow", action="append", help="allow_patterns (repeatable)")
    args = parser.parse_args()

    lp_hub.install()
    started = time.monotonic()
    path = huggingface_hub.snapshot_download(
        args.repo_id, revision=args.revision, allow_patterns=args.allow
    )
    print(f"{args.repo_id} ready at {path} in {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
