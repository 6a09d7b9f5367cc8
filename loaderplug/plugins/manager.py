"""The plugins: one process-wide plugin manager, and :class:`Plugins`, the typed facade
every job calls hooks through.

The manager holds the hook specs, the built-in plugin (``trylast``, named
``loaderplug.builtin``), the ``loaderplug`` entry points (loaded with pluggy's own
``load_setuptools_entrypoints``) and every plugin registered at run time with
:func:`register`, which therefore applies to every job that follows. A job's
``LOADERPLUG_DISABLE_PLUGINS`` keeps the named plugins out of that job's calls (and an
entry point so named from being imported at all).

Observe hooks are called plugin by plugin: one observer that raises is logged once per
job and never fails the job, nor keeps the other observers from hearing of it.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import logging
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

from loaderplug.errors import PluginError
from loaderplug.plugins import hookspecs
from loaderplug.plugins.hookspecs import PROJECT
from loaderplug.storage.io_policy import FilePolicy, decided
from loaderplug.storage.mounts import filesystem_type
from loaderplug.storage.residency import NOT_ASKED
from loaderplug.types import FileResult, IOPolicy, MirrorRequest, Source

if TYPE_CHECKING:
    from loaderplug.devices.backend import DeviceBackend
    from loaderplug.report import TransferReport
    from loaderplug.settings import Settings

BUILTIN_NAME = "loaderplug.builtin"
log = logging.getLogger(__name__)

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
# The sys.path the entry points were last looked up on, and the names a job kept out
# then (to be loaded once a job wants them).
_scanned_path: tuple[str, ...] | None = None
_held_back: frozenset[str] = frozenset()


def plugin_manager(disabled: tuple[str, ...] = ()) -> pluggy.PluginManager:
    """The process's plugin manager, with every entry point not in ``disabled`` loaded."""
    global _manager, _scanned_path, _held_back
    with _lock:
        if _manager is None:
            pm = pluggy.PluginManager(PROJECT)
            pm.add_hookspecs(hookspecs)
            from loaderplug.plugins import defaults as builtins

            pm.register(builtins, name=BUILTIN_NAME)
            _manager = pm
        path = tuple(sys.path)
        if path != _scanned_path or _held_back - set(disabled):
            _held_back = frozenset(_load_entry_points(_manager, disabled))
            _scanned_path = path
        return _manager


def register(plugin: object, name: str | None = None) -> None:
    """Register ``plugin`` (an object or module with ``@hookimpl`` functions) for every
    job from now on; it answers before the built-ins."""
    plugin_manager().register(plugin, name=name)


def unregister(plugin: object) -> None:
    plugin_manager().unregister(plugin)


def _load_entry_points(pm: pluggy.PluginManager, disabled: tuple[str, ...]) -> set[str]:
    """Load the ``loaderplug`` entry points not in ``disabled``; returns the names held
    back. A failure names the plugin and the way out."""
    if _declared_nowhere(PROJECT):
        _forget_uninstalled(pm, set())
        return set()
    _forget_uninstalled(pm, {ep.name for ep in importlib.metadata.entry_points(group=PROJECT)})
    held_back = {n for n in disabled if not pm.is_blocked(n) and pm.get_plugin(n) is None}
    for name in held_back:
        pm.set_blocked(name)
    try:
        pm.load_setuptools_entrypoints(PROJECT)
    except Exception as exc:
        raise _load_failure(pm, exc) from exc
    finally:
        for name in held_back:
            pm.unblock(name)
    return held_back


def _forget_uninstalled(pm: pluggy.PluginManager, declared: set[str]) -> None:
    """Unregister entry-point plugins that ``sys.path`` no longer declares (a path entry
    gone): the plugins in effect are those installed now."""
    for plugin, _dist in pm.list_plugin_distinfo():
        name = pm.get_name(plugin)
        if name is not None and name not in declared:
            pm.unregister(plugin)


def _load_failure(pm: pluggy.PluginManager, exc: Exception) -> PluginError:
    # pluggy loads in distribution order and stops at the first failure: that is the
    # first declared entry point neither registered nor held back.
    pending = [
        ep
        for ep in importlib.metadata.entry_points(group=PROJECT)
        if pm.get_plugin(ep.name) is None and not pm.is_blocked(ep.name)
    ]
    which = f"plugin {pending[0].name!r} ({pending[0].value})" if pending else "a plugin"
    name = pending[0].name if pending else "NAME"
    return PluginError(
        f"{which} failed to load: {exc}; fix or uninstall it, "
        f"or set LOADERPLUG_DISABLE_PLUGINS={name}"
    )


def _declared_nowhere(group: str) -> bool:
    """True only when certain that no distribution declares a ``group`` entry point:
    every ``sys.path`` entry is a plain folder, no custom finder supplies distributions,
    and no ``entry_points.txt`` there names ``group``. Parsing every installed
    distribution's metadata costs tens of milliseconds, more than a warm load of a
    whole model."""
    if any(
        hasattr(finder, "find_distributions") and finder is not importlib.machinery.PathFinder
        for finder in sys.meta_path
    ):
        return False
    section = f"[{group}]"
    for entry in sys.path:
        folder = entry or "."
        if folder.endswith(".egg") or (os.path.exists(folder) and not os.path.isdir(folder)):
            return False  # an egg, a zip or another importable file: ask importlib
        try:
            items = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        except OSError:  # unreadable: importlib would skip it, but be sure
            return False
        for item in items:
            if not item.name.endswith((".dist-info", ".egg-info")):
                continue
            try:
                with open(os.path.join(item.path, "entry_points.txt"), encoding="utf-8") as f:
                    if section in f.read():
                        return False
            except OSError:  # no entry points (or not a folder): nothing declared
                continue
    return True


class Plugins:
    """Every hook call of one job, typed, with the job's settings passed to each hook.

    ``firstresult`` hooks insist that some plugin answered; observe hooks never raise.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._pm = plugin_manager(settings.disable_plugins)
        self._disabled = frozenset(settings.disable_plugins)
        self._warned: set[tuple[str, str]] = set()
        self._warned_lock = threading.Lock()
        # Held for the job, as the plugins were when it asked first: one registered
        # meanwhile applies to the jobs that follow (see register).
        self._impls: dict[str, list[Any]] = {}

    def _answerers(self, name: str) -> list[Any]:
        """The implementations of the hook ``name`` that take part in this job, the last
        registered first (as pluggy calls them)."""
        impls = self._impls.get(name)
        if impls is None:
            hook, disabled = getattr(self._pm.hook, name), self._disabled
            impls = [i for i in reversed(hook.get_hookimpls()) if i.plugin_name not in disabled]
            self._impls[name] = impls
        return impls

    def builtin_alone(self, name: str) -> bool:
        """Whether the built-in plugin alone implements the hook ``name`` in this job (no
        other plugin answers it, wraps it or watches it, and the built-in is not kept
        out): the job may then do what the built-in does without the hook's machinery,
        or with less of it."""
        impls = self._answerers(name)
        return bool(impls) and all(i.plugin_name == BUILTIN_NAME for i in impls)

    def _caller(self, name: str) -> Any:
        hook = getattr(self._pm.hook, name)
        if not self._disabled:
            return hook
        plugins = [self._pm.get_plugin(n) for n in self._disabled]
        return self._pm.subset_hook_caller(name, [p for p in plugins if p is not None])

    def _first(self, name: str, **kwargs: Any) -> Any:
        result = self._caller(name)(settings=self.settings, **kwargs)
        if result is None:
            raise PluginError(
                f"no plugin answered {name}; is the built-in plugin disabled "
                f"(LOADERPLUG_DISABLE_PLUGINS)?"
            )
        return result

    # -- locate, policy, move -----------------------------------------------------

    def find_mirror(self, request: MirrorRequest) -> Path | None:
        """Where a copy of ``request`` lives on a volume mirror, or None."""
        found = self._caller("loaderplug_find_mirror")(request=request, settings=self.settings)
        return Path(found) if found is not None else None

    def io_policy(self, path: str | os.PathLike[str]) -> IOPolicy:
        policy: IOPolicy = self._first(
            "loaderplug_io_policy", path=os.fspath(path), mode=self.settings.direct_io
        )
        return policy

    def file_policy(self, path: Path) -> FilePolicy:
        """The policy of a file a job reads and the share of it in the page cache where
        the policy asked. Where the built-in answers alone, it is decided here without
        the hook's machinery, the page cache asked once a file (the delivery reuses the
        answer); a plugin's hook is asked for each file, as it may answer each its own
        way."""
        if not self.builtin_alone("loaderplug_io_policy"):
            return FilePolicy(self.io_policy(path), NOT_ASKED)
        # Asked of the path itself (its mount is known by device and statfs magic, each
        # mount's type read once a process): a file replaced by one on another mount
        # since it was listed gets that mount's answer, never its neighbours'.
        fs_type = filesystem_type(path)
        settings = self.settings
        return decided(path, fs_type, settings.direct_io, measure=settings.io_probe, is_file=True)

    def open_source(self, path: str, policy: IOPolicy) -> Source:
        source: Source = self._first("loaderplug_open_source", path=path, policy=policy)
        return source

    def device_backend(self, device: str) -> DeviceBackend | None:
        """What moves tensors to ``device``, or None: assembled on the host."""
        backend: DeviceBackend | None = self._caller("loaderplug_device_backend")(
            device=device, settings=self.settings
        )
        return backend

    # -- observe ------------------------------------------------------------------

    def notify_span_done(self, job: str, path: str, offset: int, length: int, retries: int) -> None:
        # The deprecated name too, for plugins not yet moved to the new one.
        for hook in ("loaderplug_on_span_done", "loaderplug_on_range_done"):
            self._notify(hook, job=job, path=path, offset=offset, length=length, retries=retries)

    def notify_file_done(self, job: str, result: FileResult) -> None:
        self._notify("loaderplug_on_file_done", job=job, result=result)

    def notify_tensor_ready(self, job: str, path: str, name: str, tensor: Any) -> None:
        if self._answerers("loaderplug_on_tensor_ready"):
            self._notify("loaderplug_on_tensor_ready", job=job, path=path, name=name, tensor=tensor)

    def watches_tensors(self) -> bool:
        """Whether a plugin hears of each tensor handed over in this job."""
        return bool(self._answerers("loaderplug_on_tensor_ready"))

    def notify_job_done(self, report: TransferReport) -> None:
        self._notify("loaderplug_on_job_done", report=report)

    def _notify(self, hook_name: str, **kwargs: Any) -> None:
        kwargs["settings"] = self.settings
        # pluggy calls the last registered first; so do we, one plugin at a time.
        impls = self._answerers(hook_name)
        if any(i.hookwrapper or i.wrapper for i in impls):
            try:  # a wrapper needs pluggy's machinery: let pluggy call them all
                self._caller(hook_name)(**kwargs)
            except Exception:
                self._warn_once(hook_name, "a hook wrapper")
            return
        for impl in impls:
            try:
                impl.function(*[kwargs[arg] for arg in impl.argnames])
            except Exception:
                self._warn_once(hook_name, impl.plugin_name)

    def _warn_once(self, hook: str, plugin: str) -> None:
        with self._warned_lock:
            first = (hook, plugin) not in self._warned
            self._warned.add((hook, plugin))
        if first:
            log.warning(
                "plugin %s: its %s raised; the job goes on (further failures of it in this "
                "job are not logged)",
                plugin,
                hook,
                exc_info=True,
            )
