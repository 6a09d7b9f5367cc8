"""vLLM: the names loaderplug relies on.

Used by :mod:`loaderplug.integrations.vllm` (``--load-format volcache``) and
:mod:`loaderplug.integrations.fastsafetensors` (``--load-format fastsafetensors``
hydrating first). vLLM runs loaderplug's plugin in every process: nothing here imports
vLLM until a function is called, and :func:`version` imports only vLLM's top package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

from loaderplug.integrations.upstream import Symbol, Upstream

if TYPE_CHECKING:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

OLDEST = (0, 8)
NEWEST_CHECKED = "0.32.0"

REGISTER_MODEL_LOADER = Symbol(
    "vllm.model_executor.model_loader",
    "register_model_loader",
    "registers --load-format volcache",
)
BASE_MODEL_LOADER = Symbol(
    "vllm.model_executor.model_loader.base_loader",
    "BaseModelLoader",
    "the base class of the volcache loader, built with the LoadConfig",
)
DOWNLOAD_MODEL = Symbol(
    "vllm.model_executor.model_loader.base_loader",
    "BaseModelLoader.download_model",
    "the volcache loader's download_model(model_config) hydrates without loading",
)
LOAD_WEIGHTS = Symbol(
    "vllm.model_executor.model_loader.base_loader",
    "BaseModelLoader.load_weights",
    "the volcache loader's load_weights(model, model_config) streams the weights in",
)
EXTRA_CONFIG = Symbol(
    "vllm.config.load",
    "LoadConfig.model_loader_extra_config",
    "--model-loader-extra-config, read as loaderplug's settings",
    instance=True,
)
MODEL = Symbol(
    "vllm.config",
    "ModelConfig.model",
    "the folder or Hub repo id the weights are located from",
    instance=True,
)
REVISION = Symbol(
    "vllm.config",
    "ModelConfig.revision",
    "the Hub revision the weights are located at",
    instance=True,
)
QUANTIZATION = Symbol(
    "vllm.config",
    "ModelConfig.quantization",
    "an unquantized model must have had every parameter loaded",
    instance=True,
)
WEIGHTS_ITERATOR = Symbol(
    "vllm.model_executor.model_loader.weight_utils",
    "fastsafetensors_weights_iterator",
    "the one name that takes --load-format fastsafetensors' file list: wrapped to "
    "hydrate the files first",
)
DEFAULT_LOADER_WEIGHTS_ITERATOR = Symbol(
    "vllm.model_executor.model_loader.default_loader",
    "fastsafetensors_weights_iterator",
    "the name DefaultModelLoader calls the iterator by: rebound to the wrapper too",
)
WORLD_GROUP = Symbol(
    "vllm.distributed.parallel_state",
    "get_world_group",
    "the world's gloo group (its cpu_group): ranks under tensor or pipeline parallelism "
    "share a load over it",
)
# Public API, recorded with the versions it was checked in.
VERSION = Symbol(
    "vllm",
    "__version__",
    f"vLLM older than {'.'.join(map(str, OLDEST))} gets no --load-format volcache",
    public=True,
)

SYMBOLS = (
    REGISTER_MODEL_LOADER,
    BASE_MODEL_LOADER,
    DOWNLOAD_MODEL,
    LOAD_WEIGHTS,
    EXTRA_CONFIG,
    MODEL,
    REVISION,
    QUANTIZATION,
    WEIGHTS_ITERATOR,
    DEFAULT_LOADER_WEIGHTS_ITERATOR,
    WORLD_GROUP,
    VERSION,
)
UPSTREAM = Upstream("vllm", OLDEST, NEWEST_CHECKED, SYMBOLS)


def version() -> str:
    """vLLM's version (imports vLLM's top package only)."""
    return UPSTREAM.version()


def missing() -> list[str]:
    """One message for each symbol the installed vLLM lacks (imports vLLM's loaders)."""
    return UPSTREAM.missing()


def register_model_loader() -> Callable[[str], Callable[[type[Any]], type[Any]]]:
    """``register_model_loader(load_format)``, a class decorator."""
    return cast(
        "Callable[[str], Callable[[type[Any]], type[Any]]]", UPSTREAM.get(REGISTER_MODEL_LOADER)
    )


def world_cpu_group() -> Any | None:
    """The gloo group of every vLLM worker, when there is more than one, else None."""
    world = UPSTREAM.get(WORLD_GROUP)()
    return world.cpu_group if world.world_size > 1 else None


def base_model_loader() -> type[BaseModelLoader]:
    return cast("type[BaseModelLoader]", UPSTREAM.get(BASE_MODEL_LOADER))


def fastsafetensors_weights_iterator() -> Callable[..., Iterator[Any]] | None:
    """vLLM's ``fastsafetensors_weights_iterator`` as ``weight_utils`` holds it now, or
    None where this vLLM has none."""
    return cast("Callable[..., Iterator[Any]] | None", UPSTREAM.find(WEIGHTS_ITERATOR))


def rebind_fastsafetensors_weights_iterator(
    current: Callable[..., Iterator[Any]], replacement: Callable[..., Iterator[Any]]
) -> None:
    """Point each of vLLM's names for the iterator that still holds ``current`` at
    ``replacement`` (``default_loader`` imported it from ``weight_utils``)."""
    for symbol in (WEIGHTS_ITERATOR, DEFAULT_LOADER_WEIGHTS_ITERATOR):
        if UPSTREAM.find(symbol) is current:
            setattr(UPSTREAM.module(symbol), symbol.attr, replacement)
