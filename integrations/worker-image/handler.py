"""A serverless worker's handler (RunPod style): the model hydrated from the volume
mirror at start, then each request served by the loaded model.

    MODEL_NAME=llama python handler.py                       # under the RunPod SDK
    MODEL_NAME=llama python handler.py --test-input '{"input": {"prompt": "hello"}}'

``MODEL_NAME`` is a model synced to ``<LOADERPLUG_MIRROR>/models/<name>`` (hydrated to
``LOADERPLUG_LOCAL_COPIES``), or a Hub repo id, downloaded through the Hub hook (the
first worker fills the mirror; the next ones hydrate from it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import loaderplug


def model_folder(name: str) -> str:
    """Where the model is read from: its local copy, hydrated from the mirror now; or
    the repo id itself, for transformers to fetch through the Hub hook."""
    mirror = loaderplug.find_mirror("folder", name)
    if mirror is not None:
        local = Path(loaderplug.from_env().local_copies) / name
        report = loaderplug.hydrate(mirror, local)
        print(f"loaderplug: {report.summary()}", flush=True)
        return str(local)
    from loaderplug.integrations import huggingface_hub as lp_hub

    lp_hub.install()  # a repo id: its downloads served from, or filling, the mirror
    return name


def start() -> tuple[Any, Any]:
    import transformers

    started = time.monotonic()
    where = model_folder(os.environ["MODEL_NAME"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(where)
    model = transformers.AutoModelForCausalLM.from_pretrained(where)
    print(f"worker ready in {time.monotonic() - started:.2f} s", flush=True)
    return model, tokenizer


MODEL, TOKENIZER = start()


def handler(event: dict[str, Any]) -> dict[str, Any]:
    """One request: ``{"input": {"prompt": str, "max_new_tokens": int}}``."""
    request = event.get("input") or {}
    ids = TOKENIZER(str(request.get("prompt", "")), return_tensors="pt")["input_ids"]
    out = MODEL.generate(ids, max_new_tokens=int(request.get("max_new_tokens", 4)), do_sample=False)
    return {"output": TOKENIZER.decode(out[0][ids.shape[1] :]), "tokens": int(out.shape[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--test-input", help="run one request locally and print the answer")
    args = parser.parse_args()
    try:
        import runpod
    except ImportError:
        runpod = None
    if args.test_input is not None or runpod is None:
        event = json.loads(args.test_input or '{"input": {"prompt": "hello"}}')
        print(json.dumps(handler(event)))
        sys.exit(0)
    runpod.serverless.start({"handler": handler})


if __name__ == "__main__":
    main()
