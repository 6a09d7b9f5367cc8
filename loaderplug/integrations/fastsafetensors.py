"""fastsafetensors through loaderplug: files hydrated from the mirror first, and the
direct/buffered choice made by loaderplug's IO policy.

    from loaderplug.integrations import fastsafetensors as lp_fst
    lp_fst.install()   # fastsafetensors' pread copier now asks loaderplug's IO policy
    with lp_fst.fastsafe_open(mirror_files, device="cpu", nogds=True) as f:
        ...            # the files were hydrated to local disk first

Two seams, both fastsafetensors' own:

* The copier registry. :func:`install` re-registers the ``nogds`` copier type (the
  pread path fastsafetensors takes without GPUDirect Storage, and on the CPU) with a
  factory that builds fastsafetensors' own copier and then makes its file descriptor
  direct or buffered as :func:`loaderplug.io_policy` says. fastsafetensors decides from a
  list of filesystem names that misses FUSE mounts and lets the lower of two stacked
  mounts win; loaderplug's policy reads the top mount and knows every ``fuse.*``.
  :func:`uninstall` puts fastsafetensors' factory back.
* The loader classes. :class:`SafeTensorsFileLoader`, :class:`ParallelLoader` and
  :class:`fastsafe_open` are fastsafetensors' own, with every file that lives on the
  mirror (a network or FUSE mount, or under ``LOADERPLUG_MIRROR``) hydrated to its local
  copy under ``LOADERPLUG_LOCAL_COPIES`` before fastsafetensors reads its header. A later
  load on the same host finds the copy current and copies nothing.

vLLM's ``--load-format fastsafetensors`` hydrates before it loads once loaderplug's vLLM
plugin has run with a mirror configured: :func:`hydrate_before_vllm_load` wraps vLLM's
``fastsafetensors_weights_iterator``, the one name in vLLM that takes the file list (no
seam exists there, so the name is rebound in the two modules that hold it).

The names these reach that are not fastsafetensors' or vLLM's public API (the copier
registry, a copier's descriptor, vLLM's iterator) are declared, with the versions they
were checked in, in :mod:`loaderplug.integrations.upstream`.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from loaderplug.errors import LoaderplugError
from loaderplug.integrations.upstream import fastsafetensors as seam
from loaderplug.jobs.local_copies import hydrate_copy, is_mirror, local_copy
from loaderplug.plugins.manager import Plugins
from loaderplug.settings import Settings, from_env
from loaderplug.types import IOPolicy

try:
    # Public API; the private names (the copier registry, a copier's descriptor) are
    # reached through loaderplug.integrations.upstream.fastsafetensors.
    import fastsafetensors
    from fastsafetensors import loader as fst_loader
    from fastsafetensors import parallel_loader
except ImportError as exc:
    raise ImportError(
        "loaderplug.integrations.fastsafetensors needs fastsafetensors: "
        "pip install 'loaderplug[fastsafetensors]'"
    ) from exc

log = logging.getLogger(__name__)


def _check_version(version: str) -> None:
    if seam.UPSTREAM.too_old(version):
        raise LoaderplugError(
            f"fastsafetensors {version} is too old: loaderplug needs "
            f"{seam.UPSTREAM.oldest_text} or newer (pip install -U fastsafetensors)"
        )


_check_version(fastsafetensors.__version__)


# -- hydrate first ---------------------------------------------------------------------


def local_files(
    paths: Iterable[str | os.PathLike[str]], settings: Settings | None = None
) -> list[str]:
    """``paths`` with every file that lives on the mirror replaced by its local copy,
    hydrated now (range-parallel, published atomically) unless already current."""
    settings = settings or from_env()
    paths = list(paths)
    by_folder: dict[Path, list[Path]] = {}
    for raw in paths:
        path = Path(raw).resolve()
        by_folder.setdefault(path.parent, []).append(path)
    copies: dict[Path, Path] = {}
    for folder, files in by_folder.items():
        if not is_mirror(folder, settings):
            continue
        copy = local_copy(folder, settings)
        hydrate_copy(folder, [p.name for p in files], copy, settings)
        copies.update({p: copy / p.name for p in files})
    return [str(copies.get(Path(raw).resolve(), raw)) for raw in paths]


def _as_file_dict(filenames: Any) -> dict[int, list[str]]:
    if isinstance(filenames, (str, os.PathLike)):
        return {0: [os.fspath(filenames)]}
    if isinstance(filenames, dict):
        return {rank: list(files) for rank, files in filenames.items()}
    return {0: list(filenames)}


def _hydrated(filenames: Any) -> dict[int, list[str]]:
    return {rank: local_files(files) for rank, files in _as_file_dict(filenames).items()}


class SafeTensorsFileLoader(fastsafetensors.SafeTensorsFileLoader):  # type: ignore[misc]
    """fastsafetensors' loader; files on the mirror are hydrated before it reads them."""

    def add_filenames(self, filenames: dict[int, list[str]]) -> None:
        super().add_filenames(_hydrated(filenames))


class ParallelLoader(parallel_loader.ParallelLoader):  # type: ignore[misc]
    """fastsafetensors' pipelined loader over the hydrated files."""

    def __init__(self, pg: Any, hf_weights_files: list[str], *args: Any, **kwargs: Any):
        super().__init__(pg, local_files(hf_weights_files), *args, **kwargs)


class fastsafe_open(fst_loader.fastsafe_open):  # type: ignore[misc]
    """fastsafetensors' ``fastsafe_open`` over the hydrated files."""

    def __init__(self, filenames: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(_hydrated(filenames), *args, **kwargs)


# -- the IO policy, through the copier registry ----------------------------------------

_original_nogds: Callable[..., Any] | None = None
# The settings the copier's policy is decided with (None: the environment's, per copier).
_policy_settings: Settings | None = None


def install(settings: Settings | None = None) -> None:
    """Make fastsafetensors' ``nogds`` copier read direct or buffered as loaderplug's IO
    policy says, under ``settings`` (default: the environment's at each file).
    Idempotent; :func:`uninstall` undoes it."""
    global _original_nogds, _policy_settings
    if settings is not None:
        _policy_settings = settings
    if _original_nogds is not None:
        return
    original = seam.nogds_factory()
    register = seam.register_copier_constructor()
    register(seam.NOGDS, seam.nogds_file_copier())(_policy_factory(original))
    _original_nogds = original


def uninstall() -> None:
    global _original_nogds, _policy_settings
    _policy_settings = None
    if _original_nogds is None:
        return
    seam.copier_registry()[seam.NOGDS] = _original_nogds
    _original_nogds = None


def _policy_factory(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def factory(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        construct = original(*args, **kwargs)

        def construct_with_policy(metadata: Any, device: Any, framework: Any) -> Any:
            copier = construct(metadata, device, framework)
            try:
                _apply_policy(copier, seam.metadata_src(metadata))
            except BaseException:
                # The copier is never handed out: nothing else closes its descriptor.
                os.close(seam.copier_fd(copier))
                raise
            return copier

        return construct_with_policy

    return factory


def _apply_policy(copier: Any, path: str) -> IOPolicy:
    """Reopen the copier's descriptor direct or buffered, as loaderplug decides."""
    policy = Plugins(_policy_settings or from_env()).io_policy(path)
    if _is_direct(seam.copier_fd(copier)) != policy.direct:
        fd = _open(path, policy.direct)
        os.close(seam.copier_fd(copier))
        seam.set_copier_fd(copier, fd)
    log.debug(
        "fastsafetensors reads %s %s (%s)",
        path,
        "direct" if _is_direct(seam.copier_fd(copier)) else "buffered",
        policy.reason,
    )
    return policy


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def _open(path: str, direct: bool) -> int:
    if direct:
        try:
            return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:  # the filesystem refuses direct IO: read buffered
            if exc.errno != 22:  # EINVAL
                raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


# -- vLLM's --load-format fastsafetensors ----------------------------------------------


def hydrate_before_vllm_load() -> None:
    """Rebind vLLM's ``fastsafetensors_weights_iterator`` to hydrate its files first."""
    from loaderplug.integrations.upstream import vllm as vllm_seam

    current = vllm_seam.fastsafetensors_weights_iterator()
    if current is None:
        log.warning("loaderplug: this vLLM has no fastsafetensors_weights_iterator to wrap")
        return
    if getattr(current, "loaderplug_hydrates", False):
        return

    @functools.wraps(current)
    def hydrating(hf_weights_files: list[str], *args: Any, **kwargs: Any) -> Iterator[Any]:
        return current(local_files(hf_weights_files), *args, **kwargs)

    hydrating.loaderplug_hydrates = True  # type: ignore[attr-defined]
    vllm_seam.rebind_fastsafetensors_weights_iterator(current, hydrating)


# -- volcache's reading backend ----------------------------------------------------------


def iter_tensors(
    paths: list[Path], settings: Settings | None = None, device: str = "cpu"
) -> Iterator[tuple[str, Any]]:
    """Every tensor of local ``paths`` through fastsafetensors (``nogds`` where there is
    no GPU), the direct/buffered choice made by loaderplug's policy under ``settings``."""
    install(settings)
    no_gds = device == "cpu"
    with fst_loader.fastsafe_open([str(p) for p in paths], device=device, nogds=no_gds) as f:
        for name in f.keys():  # noqa: SIM118 - fastsafe_open is not a mapping
            # fastsafetensors' tensors share ownership of their buffer: they stay valid
            # after the file is closed, so no copy is needed.
            yield name, f.get_tensor(name)
