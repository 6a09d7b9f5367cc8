"""Load a diffusers pipeline by repo id, unchanged: under ``loaderplug run`` every
component (each in its own subfolder) comes from the mirror.

    LOADERPLUG_MIRROR=/mnt/volume loaderplug run -- python pipeline.py org/pipeline
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repo_id")
    args = parser.parse_args()

    import torch
    from diffusers import DiffusionPipeline

    started = time.monotonic()
    pipeline = DiffusionPipeline.from_pretrained(args.repo_id)
    took = time.monotonic() - started
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(num_inference_steps=1, output_type="pt", generator=torch.manual_seed(0))
    components = sorted(name for name, part in pipeline.components.items() if part is not None)
    print(f"loaded {args.repo_id} ({', '.join(components)}) in {took:.2f} s; "
          f"one step gave an image of shape {tuple(image.images.shape)}")  # fmt: skip


if __name__ == "__main__":
    main()
