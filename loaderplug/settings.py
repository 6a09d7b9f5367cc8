"""Every ``LOADERPLUG_*`` variable, declared once, parsed once into a frozen :class:`Settings`.

Each :class:`Settings` field is declared with :func:`_setting`: its kind, default,
bounds and help text sit beside the field, and the registry (:data:`REGISTRY`), the
settings table in docs/settings.md and ``doctor`` are derived from those declarations, so a
default is never written twice.

Rules every variable follows:

* An empty value means unset; ``0`` is a value and is never replaced by a default.
* Sizes accept plain bytes or a number with a binary suffix: ``64M``, ``64MiB``, ``1GiB``,
  ``512k`` (every suffix is a power of 1024).
* A bad value raises :class:`SettingsError` naming the variable, the value, the expected
  form and the allowed range.
* An unknown ``LOADERPLUG_*`` name warns with the closest valid one.

Callers pass the environment in (``from_env(environ=...)``), so tests use plain dicts, and
keyword overrides (``from_env(readers=4)``) win over the environment.
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
from typing import Any, Literal, get_args

from loaderplug.errors import SettingsError
from loaderplug.types import (
    DirectIO,
    Distributed,
    HostSplit,
    Owned,
    RankSharing,
    WeightsDevice,
    WeightsReader,
)
from loaderplug.units import GiB, KiB, MiB, format_size, parse_size

# With LOADERPLUG_READERS=auto, readers the budget is split for when the source
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

PREFIX = "LOADERPLUG_"

# Where a setting's value came from.
Origin = Literal["default", "environment", "override"]
Kind = Literal["int", "workers", "size", "bool", "names", "choice", "path", "text"]


@dataclass(frozen=True)
class Variable:
    """One ``LOADERPLUG_*`` variable: how to parse it and what it is for."""

    field: str
    kind: Kind
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
        """The accepted form and range, as printed in errors and the settings table."""
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
        if self.kind == "text":
            return "any text"
        return "a filesystem path"

    def env_form(self, value: Any) -> str:
        """``value`` as it would be written in the environment (``on``, ``512 MiB``,
        ``a,b``), or ``unset``."""
        if value is None:
            return "unset"
        if self.kind == "bool":
            return "on" if value else "off"
        if self.kind == "size":
            return format_size(value)
        if self.kind == "names":
            return ",".join(value) or "empty"
        return str(value)

    @property
    def shown_default(self) -> str:
        """The default as the settings table shows it."""
        if self.default is None:
            return "unset"
        if self.kind == "size":
            return format_size(self.default)
        if self.kind == "bool":
            return "1" if self.default else "0"
        if self.kind == "names":
            return "empty"
        return str(self.default)


def _setting(
    kind: Kind,
    default: Any,
    help: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    choices: tuple[str, ...] = (),
) -> Any:
    """A :class:`Settings` field that is also a ``LOADERPLUG_*`` variable."""
    spec = {"kind": kind, "help": help, "minimum": minimum, "maximum": maximum}
    return field(default=default, metadata={"variable": {**spec, "choices": choices}})


@dataclass(frozen=True)
class Settings:
    """Every knob, parsed and checked. Build it with :func:`from_env`."""

    readers: int | Literal["auto"] = _setting(
        "workers",
        "auto",
        f"Readers: threads reading spans at once. auto: start at {AUTO_START_WORKERS} and "
        "adapt while reading (more while throughput rises, fewer on ENOMEM/EAGAIN or rising "
        f"latency), up to {AUTO_MAX_WORKERS} within bytes in flight from network "
        f"filesystems, {AUTO_LOCAL_WORKERS} spans of 64 MiB from local disks.",
        minimum=1,
        maximum=512,
    )
    bytes_in_flight: int = _setting(
        "size",
        512 * MiB,
        "Most bytes being read at once (readers x span size); bounds memory and volume load. "
        "A load holds at most this much of its tensors in host memory besides the ones its "
        "consumer keeps (a tensor larger than this still loads, alone).",
        minimum=4 * KiB,
        maximum=64 * GiB,
    )
    device_bytes: int | None = _setting(
        "size",
        None,
        "Most device memory a load to an accelerator (CUDA) holds for tensors it has not "
        "handed over yet, besides the ones its consumer keeps: each tensor gets memory of "
        "its own, freed when its consumer drops it (a tensor larger than this still "
        "loads, alone). Such a load reads at most this much at once (a span is cut to "
        "it). Unset: LOADERPLUG_BYTES_IN_FLIGHT.",
        minimum=4 * KiB,
        maximum=1024 * GiB,
    )
    span_bytes: int | None = _setting(
        "size",
        None,
        "Span size. Unset: bytes in flight / readers, at most 64 MiB, less for small jobs "
        "(about 8 spans per reader, at least 4 MiB). Set: used as is. Either way a load "
        "reads its first spans (4 MiB per reader) in 4 MiB steps.",
        minimum=4 * KiB,
        maximum=4 * GiB,
    )
    split_threshold_bytes: int = _setting(
        "size",
        32 * MiB,
        "Files at or over this size are split into spans; smaller ones are one span.",
        minimum=0,
        maximum=1024 * GiB,
    )
    retry_attempts: int = _setting(
        "int",
        8,
        "Attempts per span on ENOMEM, EIO, EAGAIN or ESTALE before the file fails.",
        minimum=1,
        maximum=100,
    )
    retry_base_ms: int = _setting(
        "int",
        50,
        "First retry's backoff ceiling; doubles per attempt, with full jitter.",
        minimum=0,
        maximum=60_000,
    )
    retry_max_ms: int = _setting(
        "int",
        4000,
        "Largest backoff ceiling between two attempts.",
        minimum=0,
        maximum=600_000,
    )
    fsync: bool = _setting("bool", True, "fsync each file before it is renamed into place.")
    progress: bool = _setting("bool", True, "Show a progress bar when stderr is a terminal.")
    lock_timeout_s: int = _setting(
        "int",
        3600,
        "Seconds to wait for another process hydrating the same destination.",
        minimum=0,
        maximum=7 * 24 * 3600,
    )
    object_timeout_s: int = _setting(
        "int",
        30,
        "Seconds an object store may take to answer a request, or between two parts of "
        "its answer, before the request is retried (s3://, gs://, az:// mirrors).",
        minimum=1,
        maximum=3600,
    )
    disable_plugins: tuple[str, ...] = _setting(
        "names", (), "Plugins (entry-point or registered names) that must not load."
    )
    mirror: str | None = _setting("path", None, "Root of the mirror on the volume.")
    local_copies: str | None = _setting(
        "path",
        None,
        "Where loaders keep local copies of mirrored models. Unset: "
        "$XDG_CACHE_HOME/loaderplug/models (~/.cache/loaderplug/models).",
    )
    direct_io: DirectIO = _setting(
        "choice",
        "auto",
        "O_DIRECT reads: auto (measured per mount, else by filesystem type), on, or off.",
        choices=get_args(DirectIO),
    )
    owned: Owned = _setting(
        "choice",
        "auto",
        "Whether a load's tensors own their memory or are views of a mapping of the "
        "file, as safetensors.torch.load_file's are (faster: no copy, no fresh memory). "
        "auto: files that stay put are mapped where they are read through the page "
        "cache (in memory already, or cold where buffered reads are as fast as "
        "O_DIRECT): loaderplug's own local copies and a user's files on a local "
        "filesystem (ext4, xfs, btrfs, tmpfs, overlay...), which, as with safetensors, "
        "kill the process (SIGBUS) if truncated while their tensors live; files that can "
        "change under the load (on a network or FUSE volume, the mirror) and files read "
        "with O_DIRECT are read into memory of the load's own. own: every file is read "
        "into memory of the load's own (safe whatever happens to a file; a warm file "
        "costs a copy). map: every file read in place on the CPU is mapped, wherever it "
        "lives (even on NFS), at the user's risk. Ranks sharing a load keep their own rule "
        "(LOADERPLUG_RANK_SHARING).",
        choices=get_args(Owned),
    )
    weights_reader: WeightsReader = _setting(
        "choice",
        "loaderplug",
        "What volcache reads weights with: loaderplug (one pass) or fastsafetensors "
        "(hydrate, then fastsafetensors; for hosts with GPUDirect Storage).",
        choices=get_args(WeightsReader),
    )
    weights_device: WeightsDevice = _setting(
        "choice",
        "auto",
        "Where volcache hands vLLM its weights: auto (on the model's CUDA device when one "
        "worker loads the whole model, so each is copied to the GPU once, straight from "
        "pinned memory; on the CPU under tensor or pipeline parallelism, where each "
        "worker keeps a slice), cpu, or model (the model's device, always).",
        choices=get_args(WeightsDevice),
    )
    sync: bool = _setting(
        "bool",
        True,
        "After a Hub download that the mirror could not serve, copy it to the mirror.",
    )
    fill_exit_wait_s: int = _setting(
        "int",
        30,
        "Seconds an exiting process waits for the background fill of the mirror from its "
        "local Hugging Face cache; what is not published by then is said in a warning and "
        "left to the next worker (no file is published partially). 0: do not wait.",
        minimum=0,
        maximum=24 * 3600,
    )
    trust_mirror_ref: bool = _setting(
        "bool",
        False,
        "Hub downloads take the commit a branch names from the mirror's refs/<branch> "
        "without asking the Hub (no request; a branch that moved on the Hub is not seen). "
        "Off: one request per repo and process asks the Hub, as huggingface_hub does.",
    )
    sync_wait_s: int = _setting(
        "int",
        600,
        "Seconds a hydrate waits for a sync that is writing the mirror (and a sync for "
        "another sync) before it gives up.",
        minimum=0,
        maximum=7 * 24 * 3600,
    )
    sync_stale_s: int = _setting(
        "int",
        60,
        "A sync refreshes its mark on the mirror every few seconds; a mark not refreshed "
        "for this long is a dead syncer's: the mirror is then refused until synced again.",
        minimum=2,
        maximum=24 * 3600,
    )
    distributed: Distributed = _setting(
        "choice",
        "auto",
        "auto: when a torch.distributed group has more than one rank on this host (given, "
        "or the initialised default group), the ranks split a load's files between them, "
        "each byte read once per host, and every rank gets every tensor; on several hosts, "
        "a load also splits the mirror's reads between the hosts as "
        "LOADERPLUG_HOST_SPLIT says. off: each rank reads everything itself (no sharing "
        "on a host, no split between hosts).",
        choices=get_args(Distributed),
    )
    hub_timeout_s: int = _setting(
        "int",
        10,
        "With the Hub hook on: the most a Hub request about a repo the mirror holds (a "
        "revision lookup, metadata; never a download or an upload) waits for a connection "
        "or an answer (where the caller set no timeout of its own). A timeout, "
        "a refused connection, a 5xx or a 429 then has such repos served from the mirror "
        "for a minute without asking the Hub again: one timeout per process, not per file.",
        minimum=1,
        maximum=3600,
    )
    distributed_timeout_s: int = _setting(
        "int",
        600,
        "Seconds a rank waits for the others at each step of a shared load (one file "
        "read); a rank that failed makes the others fail within it. A rank that dies on "
        "this host is noticed at once, without waiting for it.",
        minimum=1,
        maximum=24 * 3600,
    )
    io_probe: bool = _setting(
        "bool",
        True,
        "Measure O_DIRECT against buffered parallel reads once per mount (on the first "
        "cold file of 64 MiB or more a job reads there: at most 256 MiB, about a second) "
        "and use the faster from then on (kept in ~/.cache/loaderplug/io-policy.json). "
        "Off: the filesystem type decides. LOADERPLUG_DIRECT_IO=on|off wins over both.",
    )
    host_id: str | None = _setting(
        "text",
        None,
        "What tells this host's ranks from another host's when ranks share a load (they "
        "share a read, a local copy and the memory budget only with ranks of their own "
        "host). Unset: the host name and this boot of it, the mount namespace and the "
        "local folder (ranks that do not see the same files are not one host). "
        "Containers on one machine that should each count as a host of their own set "
        "one each.",
    )
    host_split: HostSplit = _setting(
        "choice",
        "auto",
        "When the ranks of a group load on several hosts (a one pass or tensors alone): "
        "on, the hosts split the mirror's ranges between them, each reads about 1/H from "
        "its own mount and they exchange what they read over the group, so the mirror is "
        "read once in all and each tensor is handed over as its bytes arrive; off, every "
        "host reads the whole model itself; auto, on with two or more hosts while the pace "
        "at which the model reached the hosts split, measured in the first rounds, beats "
        "their mounts' rate alone. One host: never.",
        choices=get_args(HostSplit),
    )
    rank_sharing: RankSharing = _setting(
        "choice",
        "auto",
        "How a tensor one rank read reaches the others: pagecache (the others map the "
        "file the reader just left in the page cache: CPU tensors from local files), "
        "broadcast (over the group; CUDA tensors, network files), stream (no copy, "
        "tensor by tensor: the others map the file the reader is reading or writing "
        "and take each tensor as soon as it landed, and a one pass's copy leaves the "
        "page cache as they are done with it; CPU tensors), or auto (as measured "
        "fastest: for CPU tensors, stream in a one pass from a network mirror and "
        "pagecache from local files; broadcast for CUDA tensors and network files read "
        "in place). Files on a network filesystem are never mapped: pagecache or stream "
        "forced there broadcasts instead, with a warning.",
        choices=get_args(RankSharing),
    )
    origins: Mapping[str, Origin] = field(default_factory=dict, compare=False, repr=False)

    @property
    def local_models_dir(self) -> Path:
        """Where loaders keep local copies of mirrored models."""
        if self.local_copies:
            return Path(self.local_copies).expanduser()
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(cache) / "loaderplug" / "models"

    def __getattr__(self, name: str) -> Any:
        # Only for names that are not fields: a renamed setting's old name.
        if name in RENAMED:
            _warn_renamed(name, RENAMED[name], stacklevel=3)
            return getattr(self, RENAMED[name])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def replace(self, **overrides: Any) -> Settings:
        """A copy with ``overrides`` (by field name) applied and checked."""
        values, origins = _parse_overrides(overrides)
        return dataclasses.replace(self, **values, origins={**self.origins, **origins})


REGISTRY: tuple[Variable, ...] = tuple(
    Variable(f.name, default=f.default, **f.metadata["variable"])
    for f in dataclasses.fields(Settings)
    if "variable" in f.metadata
)
BY_FIELD: dict[str, Variable] = {v.field: v for v in REGISTRY}
BY_NAME: dict[str, Variable] = {v.name: v for v in REGISTRY}
_ORDER = {var.name: i for i, var in enumerate(REGISTRY)}
# Settings renamed (old field name: new one). An old name keeps working, with a
# DeprecationWarning, for one release after the rename: as a variable, a keyword of
# from_env or Settings.replace, and an attribute.
RENAMED: dict[str, str] = {
    "volume": "mirror",
    "hydrate_workers": "readers",
    "chunk_bytes": "span_bytes",
    "local_dir": "local_copies",
    "reader": "weights_reader",
}


# Values of a choice renamed (field: {old value: new one}). An old value keeps working,
# with a DeprecationWarning naming the new one, for one release after the rename, wherever
# the setting is parsed: as a variable and as a keyword of from_env or Settings.replace.
RENAMED_VALUES: dict[str, dict[str, str]] = {
    "owned": {"on": "own", "off": "map"},
}


def _warn_renamed(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f"the loaderplug setting {old} ({PREFIX}{old.upper()}) is now {new} "
        f"({PREFIX}{new.upper()}); the old name goes in the next release",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _renamed_in(environ: Mapping[str, str]) -> Mapping[str, str]:
    """``environ`` with each renamed variable read under its new name (unless set)."""
    renamed = dict(environ)
    for old, new in RENAMED.items():
        raw = environ.get(PREFIX + old.upper())
        if raw is None:
            continue
        _warn_renamed(old, new, stacklevel=4)
        renamed.setdefault(PREFIX + new.upper(), raw)
    return renamed


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _bad(var: Variable, raw: object) -> SettingsError:
    return SettingsError(var.name, raw, var.expected)


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
        value = parse_size(raw)
        if value is not None:
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


def _parse_text(var: Variable, raw: object) -> str:
    if isinstance(raw, str) and raw.strip():
        return raw.strip()
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
    "text": _parse_text,
}


def parse(var: Variable, raw: object, *, stacklevel: int = 2) -> Any:
    """Parse one raw value (a string from the environment, or a Python override). An old
    value of a renamed choice warns at ``stacklevel`` (counted from here, as
    :func:`warnings.warn` counts) and parses as its new value."""
    return _PARSERS[var.kind](var, _renamed_value(var, raw, stacklevel + 1))


def _renamed_value(var: Variable, raw: object, stacklevel: int) -> object:
    """``raw``, or the new value where it is an old one of :data:`RENAMED_VALUES` (warned
    at ``stacklevel``, counted from here)."""
    old = raw.strip().lower() if isinstance(raw, str) else None
    new = RENAMED_VALUES.get(var.field, {}).get(old or "")
    if new is None:
        return raw
    warnings.warn(
        f"{var.name}={old} is now {var.name}={new} (the same behaviour); the old value "
        "goes in the next release",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return new


def _warn_unknown(environ: Mapping[str, str]) -> None:
    for name in environ:
        old = name.removeprefix(PREFIX).lower()
        if name.startswith(PREFIX) and name not in BY_NAME and old not in RENAMED:
            # An old name's typo is pointed at the new name.
            names = {n: n for n in BY_NAME}
            names |= {PREFIX + o.upper(): PREFIX + n.upper() for o, n in RENAMED.items()}
            close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
            hint = f"; did you mean {names[close[0]]}?" if close else ""
            warnings.warn(
                f"{name} is not a loaderplug setting and is ignored{hint}",
                UserWarning,
                stacklevel=3,
            )


def _parse_overrides(overrides: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Origin]]:
    values: dict[str, Any] = {}
    origins: dict[str, Origin] = {}
    for key, raw in overrides.items():
        if key in RENAMED:
            _warn_renamed(key, RENAMED[key], stacklevel=4)
            key = RENAMED[key]
        if key not in BY_FIELD:
            fields = {f: f for f in BY_FIELD} | RENAMED  # an old name's typo: the new name
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f"; did you mean {fields[close[0]]!r}?" if close else ""
            message = f"unknown setting {key!r}{hint}"
            raise SettingsError(key, None, "the name of a setting", message=message)
        if raw is None:
            continue
        values[key] = parse(BY_FIELD[key], raw, stacklevel=4)  # from_env's or replace's caller
        origins[key] = "override"
    return values, origins


def from_env(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Parse ``LOADERPLUG_*`` from ``environ`` (default ``os.environ``), then ``overrides``.

    ``overrides`` are field names (``readers=4``); ``None`` leaves a field as the
    environment set it, so callers can pass optional CLI flags straight through.
    """
    # Only LOADERPLUG_* variables are read: take them in one pass over the names, as
    # each read of os.environ encodes and decodes, and a load asks for its settings.
    source = os.environ if environ is None else environ
    ours = {name: source[name] for name in source if name.startswith(PREFIX)}
    environ = _renamed_in(ours)
    _warn_unknown(environ)
    values: dict[str, Any] = {var.field: var.default for var in REGISTRY}
    origins: dict[str, Origin] = dict.fromkeys(values, "default")
    # The variables set, parsed in the registry's order (the first bad one is named).
    for name in sorted((n for n in environ if n in BY_NAME), key=_ORDER.__getitem__):
        var = BY_NAME[name]
        raw = environ[name]
        if raw.strip():
            values[var.field] = parse(var, raw, stacklevel=3)  # from_env's caller
            origins[var.field] = "environment"
    parsed, overridden = _parse_overrides(overrides)
    values.update(parsed)
    origins.update(overridden)
    return Settings(**values, origins=origins)


def settings_table() -> str:
    """The settings table of docs/settings.md, generated from the registry."""
    rows = [
        "| Variable | Default | Accepts | What it does |",
        "|---|---|---|---|",
    ]
    was = {new: PREFIX + old.upper() for old, new in RENAMED.items()}
    rows += [
        f"| `{v.name}`{f' (was `{was[v.field]}`)' if v.field in was else ''} | "
        f"{v.shown_default} | {v.expected}{_old_values(v)} | {v.help} |"
        for v in REGISTRY
    ]
    return "\n".join(rows)


def _old_values(var: Variable) -> str:
    """The old spellings ``var`` still accepts, as the settings table shows them."""
    renamed = RENAMED_VALUES.get(var.field, {})
    said = ", ".join(f"`{old}` is now `{new}`" for old, new in renamed.items())
    return f" ({said})" if said else ""
