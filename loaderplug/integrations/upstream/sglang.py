"""SGLang: the names loaderplug relies on.

Used by :mod:`loaderplug.integrations.sglang`, a general plugin SGLang loads from its
``sglang.srt.plugins`` entry points in every process. SGLang's ``LoadFormat`` is a
closed enum, so loaderplug does not add a format: it wraps the safetensors weight
iterators the default loader calls, through SGLang's ``HookRegistry``. The targets are
dotted names that SGLang resolves when it applies the hooks (its loader module needs
SGLang's whole stack to import): ``TARGETS`` lists them, and a test reads SGLang's
source to check that they are still there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from loaderplug.integrations.upstream import Symbol, Upstream

OLDEST = (0, 5)
NEWEST_CHECKED = "0.5.23"

# The weight iterators of SGLang's default loader, by the names its loader module calls
# them with (``from .weight_utils import ...``); each takes ``hf_weights_files`` first.
LOADER_MODULE = "sglang.srt.model_loader.loader"
TARGETS = (
    f"{LOADER_MODULE}.safetensors_weights_iterator",
    f"{LOADER_MODULE}.buffered_multi_thread_safetensors_weights_iterator",
)

REGISTER = Symbol(
    "sglang.srt.plugins.hook_registry",
    "HookRegistry.register",
    "loaderplug's plugin wraps the default loader's safetensors weight iterators",
    public=True,
)
AROUND = Symbol(
    "sglang.srt.plugins.hook_registry",
    "HookType.AROUND",
    "the wrapper gets the original iterator and calls it where loaderplug stands aside",
    public=True,
)
PLUGINS_GROUP = Symbol(
    "sglang.srt.plugins",
    "GENERAL_PLUGINS_GROUP",
    "the entry-point group loaderplug's plugin is declared in",
    value="sglang.srt.plugins",
)

SYMBOLS = (REGISTER, AROUND, PLUGINS_GROUP)
UPSTREAM = Upstream("sglang", OLDEST, NEWEST_CHECKED, SYMBOLS)


def version() -> str:
    return UPSTREAM.version()


def missing() -> list[str]:
    return UPSTREAM.missing()


def register_around() -> Callable[[str, Callable[..., Any]], None]:
    """``register(target, hook)`` as an AROUND hook: ``hook(original, *args, **kwargs)``."""
    register = cast("Callable[..., None]", UPSTREAM.get(REGISTER))
    around = UPSTREAM.get(AROUND)
    return lambda target, hook: register(target, hook, around)
