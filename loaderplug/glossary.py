"""The words loaderplug uses, each for one thing, defined once, and the names of its
layers.

Settings, hooks, reports, messages and docs use these words and no others for these
things; ``docs/design.md`` shows both tables (kept equal by a test).
"""

from __future__ import annotations

TERMS: dict[str, str] = {
    "volume": "A network filesystem mounted on the worker (NFS, CIFS, Lustre, a FUSE "
    "mount of an object store): slow per stream, shared by many workers.",
    "mirror": "loaderplug's folder of models on a volume (LOADERPLUG_MIRROR), or a prefix "
    "in a bucket (s3://, gs://, az://), filled by a sync or by huggingface_hub with HF_HOME "
    "there; what a hydrate copies from.",
    "local copy": "A model's copy on the worker's fast local disk, made by a hydrate "
    "(LOADERPLUG_LOCAL_COPIES); the one folder a job publishes into.",
    "job": "One hydrate, sync, selection or load: a plan the runner executes under its "
    "lock, ending in a report.",
    "hydrate": "A job copying a model from the mirror to its local copy.",
    "sync": "A job copying a local model to the mirror, manifest last.",
    "load": "A job handing a model's tensors to a consumer as they land.",
    "one pass": "A load that hydrates at the same time: each byte read from the mirror "
    "once, written to the local copy and handed over as a tensor.",
    "span": "Contiguous bytes of one file that one reader takes at a time; a file at or "
    "over the split threshold is cut into spans of the span size (LOADERPLUG_SPAN_BYTES), "
    "a smaller one is one span (a load's first spans are 4 MiB steps, so its first "
    "tensors land early).",
    "reader": "A thread of the engine that reads spans with pread; how many read at once "
    "is the concurrency limit (LOADERPLUG_READERS).",
    "sink": "Where the engine lands a file's bytes: the temp file of a copy, a digest, a "
    "tensor sink.",
    "publish": "Renaming a copy's temp file into place once every span landed and the "
    "source held still: nothing partial is ever visible.",
    "current copy": "A published copy with the source's size and mtime: every job skips it.",
    "bytes in flight": "The most bytes being read at once (readers x span size), and a "
    "load's bound on host memory for tensors (LOADERPLUG_BYTES_IN_FLIGHT).",
    "IO policy": "Whether a file is read with O_DIRECT or buffered, and why.",
    "rank": "One process of a torch.distributed group; ranks on one host share a load.",
    "worker": "A serverless machine that starts, loads a model and serves it; many workers "
    "share one mirror.",
}

# The package's layers, lowest first: a module imports only from its own layer and the
# ones before it (tests/test_imports.py). The root's modules are the vocabulary; its
# ``__init__`` (the public API) sits on top of everything.
LAYERS = (
    "vocabulary",
    "storage",
    "engine",
    "devices",
    "plugins",
    "jobs",
    "tensors",
    "integrations",
    "testing",
    "cli",
)

# Inside a layer, its sub-packages in the same way, lowest first: a module of one imports
# from its own and those before it; the layer's own modules (its entry points) sit on
# top of them all.
SUBLAYERS: dict[str, tuple[str, ...]] = {
    "tensors": ("format", "memory", "device", "delivery", "ranks", "hosts"),
    "integrations": ("upstream", "hub"),
}
