"""The plugin manager: hook specs, then built-ins (``trylast``), then entry points.

Third-party plugins are found through the ``loaderplug`` entry-point group. Any plugin,
built-in ones included, can be kept from loading by naming it in
``LOADERPLUG_DISABLE_PLUGINS`` (built-ins are named ``loaderplug.builtin``).
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.metadata
import os
import sys
from typing import Any

import pluggy

from loaderplug import hookspecs
from loaderplug.errors import PluginError
from loaderplug.hookspecs import PROJECT

BUILTIN_NAME = "loaderplug.builtin"


def plugin_manager(disabled: tuple[str, ...] = ()) -> pluggy.PluginManager:
    """The shared plugin manager for this set of disabled plugin names.

    Plugins registered at run time (``plugin_manager().register(obj)``) stay with it.
    """
    return _build(tuple(sorted(set(disabled))))


@functools.lru_cache(maxsize=8)
def _build(disabled: tuple[str, ...]) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in disabled:
        pm.set_blocked(name)
    from loaderplug import builtins

    if not pm.is_blocked(BUILTIN_NAME):
        pm.register(builtins, name=BUILTIN_NAME)
    for ep in _entry_points():
        if pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}; "
                f"fix or uninstall it, or set LOADERPLUG_DISABLE_PLUGINS={ep.name}"
            ) from exc
        pm.register(plugin, name=ep.name)
    return pm


def _entry_points() -> importlib.metadata.EntryPoints:
    """The ``loaderplug`` entry points, without parsing every installed distribution's
    metadata when none declares one: that full scan costs tens of milliseconds, more
    than a warm load of a whole model."""
    if _declared_nowhere(PROJECT):
        return importlib.metadata.EntryPoints(())
    return importlib.metadata.entry_points(group=PROJECT)


def _declared_nowhere(group: str) -> bool:
    """True only when certain: every ``sys.path`` entry is a plain folder, no custom
    finder supplies distributions, and no ``entry_points.txt`` there names ``group``."""
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


def first_result(pm: pluggy.PluginManager, hook_name: str, **kwargs: Any) -> Any:
    """Call a ``firstresult`` hook and insist that some plugin answered."""
    result = getattr(pm.hook, hook_name)(**kwargs)
    if result is None:
        raise PluginError(
            f"no plugin answered {hook_name}; is the built-in plugin disabled "
            f"(LOADERPLUG_DISABLE_PLUGINS)?"
        )
    return result
