"""SGLang: its safetensors weights come through loaderplug when a mirror is configured.

SGLang loads the general plugins of the ``sglang.srt.plugins`` entry-point group in
every process (loaderplug declares :func:`register` there; ``SGLANG_PLUGINS`` filters
them). Its ``--load-format`` is a closed enum, so the plugin wraps, through SGLang's
``HookRegistry``, the safetensors weight iterators its default loader calls (see
:mod:`.upstream.sglang`): with ``LOADERPLUG_MIRROR`` set, the weights stream through
loaderplug (:func:`loaderplug.integrations.volcache.stream`): files on the mirror are
hydrated to their local copy in the same pass as they are loaded, a current local copy
is read instead, and each file is read direct or buffered as its mount wants. Without
a mirror, or for arguments loaderplug does not take over, SGLang's own iterator runs.

SGLang's downloads by repo id go through the Hub hook, which the plugin installs where
a mirror is set (and which ``loaderplug run`` installs in every process anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from loaderplug.integrations.upstream import sglang as seam
from loaderplug.jobs.local_copies import is_mirror, local_copy
from loaderplug.settings import from_env

log = logging.getLogger(__name__)


def register() -> None:
    """SGLang's entry point: wrap its weight iterators; the Hub hook where a mirror is set."""
    for target in seam.TARGETS:
        seam.register_around()(target, weights_through_loaderplug)
    try:
        if from_env().mirror:
            from loaderplug.integrations import huggingface_hub as lp_hub

            lp_hub.install()
    except Exception as exc:  # SGLang still loads: its own downloads, unchanged
        log.warning("loaderplug: the Hub hook is off in this SGLang process: %s", exc)


def weights_through_loaderplug(
    original: Callable[..., Iterator[tuple[str, Any]]],
    hf_weights_files: list[str],
    *args: Any,
    **kwargs: Any,
) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for every weight of ``hf_weights_files``, through loaderplug
    where a mirror is configured, else from ``original`` (SGLang's iterator) as called."""
    settings = from_env()
    files = [Path(f) for f in hf_weights_files]
    if not settings.mirror or not files or any(f.suffix != ".safetensors" for f in files):
        return original(hf_weights_files, *args, **kwargs)
    from loaderplug.integrations import volcache

    folder = files[0].parent
    on_mirror = len({f.parent for f in files}) == 1 and is_mirror(folder, settings)
    weights = volcache.ModelWeights(
        str(folder), folder, files, local_copy(folder, settings) if on_mirror else None
    )
    # Each SGLang rank loads every weight with its own process group (NCCL on GPUs): the
    # ranks read alone here, and share the local copy through its lock.
    return volcache.stream(weights, settings.replace(distributed="off"))
