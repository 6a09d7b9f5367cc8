"""fastsafetensors: the names loaderplug relies on.

Used by :mod:`loaderplug.integrations.fastsafetensors`: its loader classes subclass
fastsafetensors' public ones, and its IO policy reaches into the copier registry, which
has no public getter, and into a copier's file descriptor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from loaderplug.integrations.upstream import Symbol, Upstream, UpstreamChanged

OLDEST = (0, 5)
NEWEST_CHECKED = "0.5.0"

# The copier type fastsafetensors reads with without GPUDirect Storage (and on the CPU).
NOGDS = "nogds"

COPIER_REGISTRY = Symbol(
    "fastsafetensors.copier.registry",
    "_copier_registry",
    f"the registry has no getter: install() reads the {NOGDS!r} copier factory there to "
    "wrap it (a factory(device, **kwargs) returning construct(metadata, device, "
    "framework)), and uninstall() puts it back",
)
REGISTER_COPIER_CONSTRUCTOR = Symbol(
    "fastsafetensors.copier.registry",
    "register_copier_constructor",
    f"install() registers the wrapped {NOGDS!r} factory with it",
)
NOGDS_FILE_COPIER = Symbol(
    "fastsafetensors.copier.nogds",
    "NoGdsFileCopier",
    f"the class the {NOGDS!r} factory builds, registered with the wrapped factory",
)
COPIER_FD = Symbol(
    "fastsafetensors.copier.nogds",
    "NoGdsFileCopier.fd",
    "the copier's file descriptor, reopened direct or buffered as loaderplug's IO policy says",
    instance=True,
)
METADATA_SRC = Symbol(
    "fastsafetensors.common",
    "SafeTensorsMetadata.src",
    "the path of the file a copier is built for, which the IO policy decides on",
    instance=True,
)
# Public API, recorded with the versions it was checked in.
VERSION = Symbol(
    "fastsafetensors",
    "__version__",
    f"fastsafetensors older than {'.'.join(map(str, OLDEST))} is refused",
    public=True,
)
SAFETENSORS_FILE_LOADER = Symbol(
    "fastsafetensors",
    "SafeTensorsFileLoader.add_filenames",
    "loaderplug's SafeTensorsFileLoader hydrates the files it is given first",
    public=True,
)
PARALLEL_LOADER = Symbol(
    "fastsafetensors.parallel_loader",
    "ParallelLoader",
    "loaderplug's ParallelLoader hydrates its files first",
    public=True,
)
FASTSAFE_OPEN = Symbol(
    "fastsafetensors.loader",
    "fastsafe_open",
    "loaderplug's fastsafe_open hydrates its files first; volcache reads through it",
    public=True,
)

SYMBOLS = (
    COPIER_REGISTRY,
    REGISTER_COPIER_CONSTRUCTOR,
    NOGDS_FILE_COPIER,
    COPIER_FD,
    METADATA_SRC,
    VERSION,
    SAFETENSORS_FILE_LOADER,
    PARALLEL_LOADER,
    FASTSAFE_OPEN,
)
UPSTREAM = Upstream("fastsafetensors", OLDEST, NEWEST_CHECKED, SYMBOLS)


def version() -> str:
    return UPSTREAM.version()


def missing() -> list[str]:
    """One message for each symbol the installed fastsafetensors lacks, and for the
    ``nogds`` copier if it is not registered."""
    problems = UPSTREAM.missing()
    if not problems:
        try:
            nogds_factory()
        except UpstreamChanged as exc:
            problems.append(str(exc))
    return problems


def copier_registry() -> dict[str, Callable[..., Any]]:
    """fastsafetensors' registry of copier factories, by copier type (the dict itself)."""
    return cast("dict[str, Callable[..., Any]]", UPSTREAM.get(COPIER_REGISTRY))


def register_copier_constructor() -> Callable[..., Callable[[Any], Any]]:
    """``register_copier_constructor(copier_type, copier_class)``, a decorator."""
    return cast("Callable[..., Callable[[Any], Any]]", UPSTREAM.get(REGISTER_COPIER_CONSTRUCTOR))


def nogds_file_copier() -> type[Any]:
    return cast("type[Any]", UPSTREAM.get(NOGDS_FILE_COPIER))


def nogds_factory() -> Callable[..., Any]:
    """The factory registered for the ``nogds`` copier now."""
    nogds_file_copier()  # importing its module registers it
    try:
        return copier_registry()[NOGDS]
    except KeyError:
        raise UPSTREAM.changed(COPIER_REGISTRY, f"has no {NOGDS!r} copier registered") from None


def copier_fd(copier: Any) -> int:
    """The file descriptor a copier reads from."""
    return cast(int, UPSTREAM.attribute(copier, COPIER_FD))


def set_copier_fd(copier: Any, fd: int) -> None:
    UPSTREAM.set_attribute(copier, COPIER_FD, fd)


def metadata_src(metadata: Any) -> str:
    """The path of the file a copier is built for."""
    return cast(str, UPSTREAM.attribute(metadata, METADATA_SRC))
