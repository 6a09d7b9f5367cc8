"""A worker that loads a model by its Hub repo id with transformers, unchanged: run it
under ``loaderplug run`` and its downloads come from the mirror.

    LOADERPLUG_MIRROR=/mnt/volume loaderplug run -- python worker.py org/model [--revision R]
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("repo_id")
    parser.add_argument("--revision", default=None)
    args = parser.parse_args()

    import transformers

    started = time.monotonic()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.repo_id, revision=args.revision)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.repo_id, revision=args.revision)
    took = time.monotonic() - started
    params = sum(p.numel() for p in model.parameters())
    print(f"loaded {args.repo_id}: {params} parameters, {len(tokenizer)} tokens, in {took:.2f} s")


if __name__ == "__main__":
    main()
