"""One registry of ``LOADERPLUG_*`` variables, parsed once into a frozen :class:`Settings`.

Rules every variable follows:

* An empty value means unset; ``0`` is a value and is never replaced by a default.
* Sizes accept plain bytes or a number with a binary suffix: ``64M``, ``64MiB``, ``1GiB``,
  ``512k`` (every suffix is a power of 1024).
* A bad value raises :class:`SettingsError` naming the variable, the value, the expected
  form and the allowed range.
* An unknown ``LOADERPLUG_*`` name warns with the closest valid one.

Callers pass the environment in (``from_env(environ=...)``), so tests use plain dicts, and
keyword overrides (``from_env(hydrate_workers=4)``) win over the environment.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from loaderplug.errors import SettingsError

PREFIX = "LOADERPLUG_"
KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

Source = Literal["default", "environment", "override"]

# Derived chunks shrink until a job has about this many ranges per worker.
RANGES_PER_WORKER = 8
# With LOADERPLUG_HYDRATE_WORKERS=auto, readers the budget is split for when the source
# is on a network filesystem: many streams beat a per-stream cap, and the adaptive limit
# may climb this high (fewer when an explicit chunk leaves less room in the budget).
AUTO_MAX_WORKERS = 32
# ... and when it is on a local disk, which has no per-stream cap: few long ranges beat
# many short ones there (8 x 64 MiB was the best fixed setting on local disk in five of
# six runs of benchmarks/auto_bench.py, and 5-29% ahead of 8 x 16 MiB in all six).
AUTO_LOCAL_WORKERS = 8
# ... and where auto starts, which small jobs' ranges are fitted for. A model of a GiB
# is copied in a few seconds, too few windows to climb from far below: starting at 16
# reached 32 x 16 MiB's speed on the network volume where starting at 8 fell 10-20%
# behind, and an object store that refuses more than 6 reads in flight costs about ten
# retries and no failed file (benchmarks/auto_bench.py).
AUTO_START_WORKERS = 16


@dataclass(frozen=True)
class Variable:
    """One ``LOADERPLUG_*`` variable: how to parse it and what it is for."""

    field: str
    kind: Literal["int", "workers", "size", "bool", "names", "choice", "path"]
    default: Any
    help: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return PREFIX + self.field.upper()

    @property
    def expected(self) -> str:
        """The accepted form and range, as printed in errors and the README."""
        if self.kind == "int":
            return f"an integer from {self.minimum} to {self.maximum}"
        if self.kind == "workers":
            return f"auto, or an integer from {self.minimum} to {self.maximum}"
        if self.kind == "size":
            assert self.minimum is not None and self.maximum is not None
            low, high = format_size(self.minimum), format_size(self.maximum)
            return f"a size in bytes such as 64M or 1GiB, from {low} to {high}"
        if self.kind == "bool":
            return "one of 1, 0, true, false, yes, no, on, off"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "names":
            return "a comma-separated list of names"
        return "a filesystem path"


REGISTRY: tuple[Variable, ...] = (
    Variable(
        "hydrate_workers",
        "workers",
        "auto",
        "Worker threads copying ranges. auto: start at 16 and adapt while copying (more "
        "while throughput rises, fewer on ENOMEM/EAGAIN or rising latency), up to "
        f"{AUTO_MAX_WORKERS} within bytes in flight from network filesystems, "
        f"{AUTO_LOCAL_WORKERS} of 64 MiB ranges from local disks.",
        minimum=1,
        maximum=512,
    ),
    Variable(
        "bytes_in_flight",
        "size",
        512 * MiB,
        "Most bytes being read at once (workers x chunk); bounds memory and volume load.",
        minimum=4 * KiB,
        maximum=64 * GiB,
    ),
    Variable(
        "chunk_bytes",
        "size",
        None,
        "Range size. Unset: bytes in flight / workers, at most 64 MiB, less for small jobs "
        "(about 8 ranges per worker, at least 4 MiB). Set: used as is.",
        minimum=4 * KiB,
        maximum=4 * GiB,
    ),
    Variable(
        "split_threshold_bytes",
        "size",
        32 * MiB,
        "Files at or over this size are split into ranges; smaller ones are copied whole.",
        minimum=0,
        maximum=1024 * GiB,
    ),
    Variable(
        "retry_attempts",
        "int",
        8,
        "Attempts per range on ENOMEM, EIO or EAGAIN before the file fails.",
        minimum=1,
        maximum=100,
    ),
    Variable(
        "retry_base_ms",
        "int",
        50,
        "First retry's backoff ceiling; doubles per attempt, with full jitter.",
        minimum=0,
        maximum=60_000,
    ),
    Variable(
        "retry_max_ms",
        "int",
        4000,
        "Largest backoff ceiling between two attempts.",
        minimum=0,
        maximum=600_000,
    ),
    Variable("fsync", "bool", True, "fsync each file before it is renamed into place."),
    Variable("progress", "bool", True, "Show a progress bar when stderr is a terminal."),
    Variable(
        "lock_timeout_s",
        "int",
        3600,
        "Seconds to wait for another process hydrating the same destination.",
        minimum=0,
        maximum=7 * 24 * 3600,
    ),
    Variable(
        "disable_plugins",
        "names",
        (),
        "Plugins (entry-point or registered names) that must not load.",
    ),
    Variable("volume", "path", None, "Root of the volume mirror."),
    Variable(
        "local_dir",
        "path",
        None,
        "Where loaders keep local copies of mirrored models. Unset: "
        "$XDG_CACHE_HOME/loaderplug/models (~/.cache/loaderplug/models).",
    ),
    Variable(
        "direct_io",
        "choice",
        "auto",
        "O_DIRECT reads: auto (by filesystem type), on, or off.",
        choices=("auto", "on", "off"),
    ),
    Variable(
        "reader",
        "choice",
        "loaderplug",
        "What volcache reads weights with: loaderplug (one pass) or fastsafetensors "
        "(hydrate, then fastsafetensors; for hosts with GPUDirect Storage).",
        choices=("loaderplug", "fastsafetensors"),
    ),
    Variable(
        "sync",
        "bool",
        True,
        "After a Hub download that the mirror could not serve, copy it to the mirror.",
    ),
)

BY_FIELD: dict[str, Variable] = {v.field: v for v in REGISTRY}
BY_NAME: dict[str, Variable] = {v.name: v for v in REGISTRY}

_SIZE = re.compile(r"^\s*(\d+)\s*(?:([kKmMgGtT])(i?[bB])?|[bB])?\s*$")
_SCALE = {"k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def format_size(n: int) -> str:
    """``67108864`` → ``64 MiB``: the largest binary unit that divides ``n``."""
    for unit, scale in (("TiB", 1024 * GiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Settings:
    """Every knob, parsed and checked. Build it with :func:`from_env`."""

    hydrate_workers: int | Literal["auto"] = "auto"
    bytes_in_flight: int = 512 * MiB
    chunk_bytes: int | None = None
    split_threshold_bytes: int = 32 * MiB
    retry_attempts: int = 8
    retry_base_ms: int = 50
    retry_max_ms: int = 4000
    fsync: bool = True
    progress: bool = True
    lock_timeout_s: int = 3600
    disable_plugins: tuple[str, ...] = ()
    volume: str | None = None
    local_dir: str | None = None
    direct_io: str = "auto"
    reader: str = "loaderplug"
    sync: bool = True
    sources: Mapping[str, Source] = field(default_factory=dict, compare=False, repr=False)

    @property
    def adaptive_workers(self) -> bool:
        """``LOADERPLUG_HYDRATE_WORKERS=auto``: the engine adapts concurrency as it runs."""
        return self.hydrate_workers == "auto"

    def _split_workers(self, *, network: bool) -> int:
        """The worker count the budget is divided by to derive a range size: with auto,
        the most readers it may climb to from a ``network`` source or a local one."""
        if self.hydrate_workers != "auto":
            return self.hydrate_workers
        return AUTO_MAX_WORKERS if network else AUTO_LOCAL_WORKERS

    @property
    def _fit_workers(self) -> int:
        """The worker count a small job's ranges are fitted for."""
        return AUTO_START_WORKERS if self.hydrate_workers == "auto" else self.hydrate_workers

    @property
    def effective_chunk_bytes(self) -> int:
        """The range size from a network filesystem; see :meth:`chunk_for_source`."""
        return self.chunk_for_source(network=True)

    def chunk_for_source(self, *, network: bool) -> int:
        """The range size: an explicit chunk as given, else bytes in flight / workers.

        The derived size is capped at 64 MiB (larger ranges stop helping and delay the
        first finished file) and rounded down to 4 KiB so O_DIRECT offsets stay aligned.
        With auto workers the budget is split for the most readers auto may run from a
        ``network`` source or a local one.
        """
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        share = min(64 * MiB, self.bytes_in_flight // self._split_workers(network=network))
        return max(4 * KiB, share // (4 * KiB) * (4 * KiB))

    def chunk_for_job(self, total_bytes: int, *, network: bool = True) -> int:
        """The range size for a job of ``total_bytes``; ``network``: whether a source is
        on a network filesystem.

        A derived chunk also shrinks for small jobs, so that every worker (with auto,
        each of the readers it starts with) gets about eight ranges: on a volume with a
        per-stream cap, four 64 MiB ranges of a 256 MiB model would leave half of eight
        workers idle, and the last ranges, which land after every read is done, are
        short. It never goes below 4 MiB, where per-request overhead starts to dominate.
        An explicit chunk is used as is, and so is auto's long range from a local disk,
        where one reader gets the device's pace and no per-stream cap idles the others.
        """
        chunk = self.chunk_for_source(network=network)
        if self.chunk_bytes is not None or (self.adaptive_workers and not network):
            return chunk
        per_worker = total_bytes // (self._fit_workers * RANGES_PER_WORKER)
        # A power of two keeps ranges aligned for O_DIRECT and sizes predictable.
        fitted = max(4 * MiB, 1 << max(per_worker, 1).bit_length() - 1)
        return min(chunk, fitted)

    def workers_for_chunk(self, chunk: int) -> int:
        """Workers that may run at once without exceeding the bytes-in-flight budget;
        with auto workers, the most the adaptive limit may climb to."""
        return min(self._split_workers(network=True), max(1, self.bytes_in_flight // chunk))

    @property
    def effective_workers(self) -> int:
        return self.workers_for_chunk(self.effective_chunk_bytes)

    @property
    def local_models_dir(self) -> Path:
        """Where loaders keep local copies of mirrored models."""
        if self.local_dir:
            return Path(self.local_dir).expanduser()
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(cache) / "loaderplug" / "models"

    def replace(self, **overrides: Any) -> Settings:
        """A copy with ``overrides`` (by field name) applied and checked."""
        values, sources = _parse_overrides(overrides)
        return dataclasses.replace(self, **values, sources={**self.sources, **sources})


def _bad(var: Variable, raw: object) -> SettingsError:
    return SettingsError(f"{var.name}={raw!r} is invalid: expected {var.expected}")


def _check_range(var: Variable, raw: object, value: int) -> int:
    low = var.minimum if var.minimum is not None else value
    high = var.maximum if var.maximum is not None else value
    if not low <= value <= high:
        raise _bad(var, raw)
    return value


def _parse_int(var: Variable, raw: object) -> int:
    # bool is an int subclass; True as a worker count is a mistake, not 1.
    if isinstance(raw, bool):
        raise _bad(var, raw)
    if isinstance(raw, int):
        return _check_range(var, raw, raw)
    if isinstance(raw, str) and re.fullmatch(r"\s*[+-]?\d+\s*", raw):
        return _check_range(var, raw, int(raw))
    raise _bad(var, raw)


def parse_size(raw: str, name: str) -> int:
    """A size such as ``64M`` or ``1GiB`` in bytes; a bad one is an error naming ``name``."""
    match = _SIZE.match(raw)
    if not match:
        raise SettingsError(f"{name}={raw!r} is invalid: expected a size such as 64M or 1GiB")
    number, unit = int(match.group(1)), match.group(2)
    return number * _SCALE[unit.lower()] if unit else number


def _parse_workers(var: Variable, raw: object) -> int | Literal["auto"]:
    if isinstance(raw, str) and raw.strip().lower() == "auto":
        return "auto"
    return _parse_int(var, raw)


def _parse_size(var: Variable, raw: object) -> int:
    if isinstance(raw, bool):
        raise _bad(var, raw)
    if isinstance(raw, int):
        return _check_range(var, raw, raw)
    if isinstance(raw, str):
        match = _SIZE.match(raw)
        if match:
            number, unit = int(match.group(1)), match.group(2)
            value = number * _SCALE[unit.lower()] if unit else number
            return _check_range(var, raw, value)
    raise _bad(var, raw)


def _parse_bool(var: Variable, raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str):
        lowered = raw.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    raise _bad(var, raw)


def _parse_names(var: Variable, raw: object) -> tuple[str, ...]:
    if isinstance(raw, str):
        return tuple(name.strip() for name in raw.split(",") if name.strip())
    if isinstance(raw, (list, tuple)) and all(isinstance(n, str) for n in raw):
        return tuple(raw)
    raise _bad(var, raw)


def _parse_choice(var: Variable, raw: object) -> str:
    if isinstance(raw, str) and raw.strip().lower() in var.choices:
        return raw.strip().lower()
    raise _bad(var, raw)


def _parse_path(var: Variable, raw: object) -> str:
    if isinstance(raw, (str, os.PathLike)):
        return os.fspath(raw)
    raise _bad(var, raw)


_PARSERS: dict[str, Callable[[Variable, object], Any]] = {
    "int": _parse_int,
    "workers": _parse_workers,
    "size": _parse_size,
    "bool": _parse_bool,
    "names": _parse_names,
    "choice": _parse_choice,
    "path": _parse_path,
}


def parse(var: Variable, raw: object) -> Any:
    """Parse one raw value (a string from the environment, or a Python override)."""
    return _PARSERS[var.kind](var, raw)


def _warn_unknown(environ: Mapping[str, str]) -> None:
    for name in environ:
        if name.startswith(PREFIX) and name not in BY_NAME:
            close = difflib.get_close_matches(name, list(BY_NAME), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            warnings.warn(
                f"{name} is not a loaderplug setting and is ignored{hint}",
                UserWarning,
                stacklevel=3,
            )


def _parse_overrides(overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Source]]:
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for key, raw in overrides.items():
        if key not in BY_FIELD:
            close = difflib.get_close_matches(key, list(BY_FIELD), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SettingsError(f"unknown setting {key!r}{hint}")
        if raw is None:
            continue
        values[key] = parse(BY_FIELD[key], raw)
        sources[key] = "override"
    return values, sources


def from_env(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Parse ``LOADERPLUG_*`` from ``environ`` (default ``os.environ``), then ``overrides``.

    ``overrides`` are field names (``hydrate_workers=4``); ``None`` leaves a field as the
    environment set it, so callers can pass optional CLI flags straight through.
    """
    environ = os.environ if environ is None else environ
    _warn_unknown(environ)
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for var in REGISTRY:
        raw = environ.get(var.name, "")
        if raw.strip() == "":
            values[var.field] = var.default
            sources[var.field] = "default"
        else:
            values[var.field] = parse(var, raw)
            sources[var.field] = "environment"
    parsed, overridden = _parse_overrides(overrides)
    values.update(parsed)
    sources.update(overridden)
    return Settings(**values, sources=sources)


def settings_table() -> str:
    """The README's settings table, generated from the registry."""
    rows = [
        "| Variable | Default | Accepts | What it does |",
        "|---|---|---|---|",
    ]
    for var in REGISTRY:
        if var.default is None:
            default = "unset"
        elif var.kind == "size":
            default = format_size(var.default)
        elif var.kind == "bool":
            default = "1" if var.default else "0"
        elif var.kind == "names":
            default = "empty"
        else:
            default = str(var.default)
        rows.append(f"| `{var.name}` | {default} | {var.expected} | {var.help} |")
    return "\n".join(rows)
