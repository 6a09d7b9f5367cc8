"""A stand-in for SGLang's loader module (``sglang.srt.model_loader.loader``, which
needs SGLang's whole stack to import): its safetensors weight iterator as SGLang 0.5.23
defines it, for SGLang's own HookRegistry to wrap in tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

CALLS: list[tuple[list[str], dict[str, Any]]] = []


def safetensors_weights_iterator(
    hf_weights_files: list[str],
    disable_mmap: bool = False,
    prefetch: bool = False,
    prefetch_num_threads: int = 4,
    drop_cache_after_load: bool = False,
) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    CALLS.append((list(hf_weights_files), {"disable_mmap": disable_mmap}))
    for path in hf_weights_files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118
                yield name, f.get_tensor(name)
