"""Plugins: the hooks (:mod:`.hookspecs`), the plugin manager (:mod:`.manager`) and the
built-in answers (:mod:`.defaults`), which any registered plugin overrides."""

from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.plugins.manager import Plugins, register, unregister

__all__ = ["Plugins", "hookimpl", "register", "unregister"]
