"""Every name loaderplug reaches inside huggingface_hub, fastsafetensors and vLLM, in one
module per upstream: the seams that break when an upstream moves things.

Each module (:mod:`.huggingface_hub`, :mod:`.fastsafetensors`, :mod:`.vllm`) declares

* ``OLDEST``, the oldest version loaderplug supports, and ``NEWEST_CHECKED``, the newest
  version its seams were checked against (for the record: a newer one is not refused);
* ``SYMBOLS``, every name loaderplug uses there (a :class:`Symbol`: the module's dotted
  path, the attribute, and why loaderplug needs it), the public ones marked so;
* one function per symbol, which imports the upstream on first use and raises
  :class:`UpstreamChanged`, naming the library, its version, the symbol and its use, where
  the name is gone;
* ``missing()``, which checks every symbol without side effects beyond importing.

Importing these modules imports no upstream: vLLM runs loaderplug's plugin in every
process, and it must stay cheap. An upstream that is not installed at all is an
``ImportError``, as it always was, so callers can still say how to install it.
"""

from __future__ import annotations

import importlib
import re
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from loaderplug.errors import UpstreamChanged

__all__ = ["Symbol", "Upstream", "UpstreamChanged", "version_tuple"]


@dataclass(frozen=True)
class Symbol:
    """One name loaderplug uses in an upstream: ``module`` (a dotted import path), ``attr``
    (dotted for a class's member, empty for the module itself) and ``why``.

    ``instance``: the last part of ``attr`` is an attribute of the class's instances (set
    in ``__init__``, or a declared field), which the class itself need not have.
    ``value``: the value loaderplug relies on, for a constant it mirrors (None: any).
    """

    module: str
    attr: str
    why: str
    public: bool = False
    instance: bool = False
    value: int | str | None = None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


def version_tuple(version: str) -> tuple[int, ...]:
    """``major.minor`` of a version string, each the piece's leading digits (0 if none):
    ``0.32.0+cpu`` is (0, 32), ``0.5rc1`` is (0, 5)."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = re.match(r"\d*", piece)
        parts.append(int(digits.group() if digits and digits.group() else 0))
    return tuple(parts)


@dataclass(frozen=True)
class Upstream:
    """One upstream library: the versions checked, and the symbols loaderplug uses."""

    library: str  # its import name
    oldest: tuple[int, ...]
    newest_checked: str
    symbols: tuple[Symbol, ...]

    @property
    def oldest_text(self) -> str:
        return ".".join(map(str, self.oldest))

    def version(self) -> str:
        """The installed version (imports the library; ``ImportError`` if it is absent)."""
        return str(importlib.import_module(self.library).__version__)

    def installed_version(self) -> str:
        """The version of the library as already imported, without importing it."""
        return str(getattr(sys.modules.get(self.library), "__version__", "(version unknown)"))

    def changed(self, symbol: Symbol, problem: str) -> UpstreamChanged:
        """The error for ``symbol``, which has ``problem`` in the installed version."""
        version = self.installed_version()
        return UpstreamChanged(
            f"{self.library} {version}: {symbol.name} {problem}; loaderplug needs it: "
            f"{symbol.why} (loaderplug's seams were checked with {self.library} "
            f"{self.oldest_text} to {self.newest_checked}; see "
            f"loaderplug.integrations.upstream.{self.library})",
            self.library,
            version,
            symbol,
        )

    def too_old(self, version: str) -> bool:
        return version_tuple(version) < self.oldest

    def module(self, symbol: Symbol) -> ModuleType:
        """The module ``symbol`` lives in, imported now. ``ImportError`` where the library
        is not installed; :class:`UpstreamChanged` where it has no such module."""
        importlib.import_module(self.library)
        try:
            return importlib.import_module(symbol.module)
        except ModuleNotFoundError as exc:
            gone = exc.name or ""
            if gone == symbol.module or symbol.module.startswith(gone + "."):
                raise self.changed(symbol, f"is not there (no module {gone})") from exc
            raise  # something the module imports is missing: an install problem

    def get(self, symbol: Symbol) -> Any:
        """What ``symbol`` names, looked up now (a class, for an instance attribute)."""
        found: Any = self.module(symbol)
        parts = symbol.attr.split(".") if symbol.attr else []
        if symbol.instance:
            *parts, member = parts
        for i, part in enumerate(parts):
            try:
                found = getattr(found, part)
            except AttributeError:
                where = ".".join([symbol.module, *parts[:i]])
                problem = f"is not there ({where} has no {part})"
                raise self.changed(symbol, problem) from None
        if symbol.instance and not _instances_have(found, member):
            raise self.changed(
                symbol, f"is not there ({found.__name__} instances have no {member})"
            )
        if symbol.value is not None and found != symbol.value:
            raise self.changed(symbol, f"is {found!r}, not {symbol.value!r}")
        return found

    def find(self, symbol: Symbol) -> Any | None:
        """What ``symbol`` names, or None where this version has no such name."""
        try:
            return self.get(symbol)
        except UpstreamChanged:
            return None

    def attribute(self, obj: Any, symbol: Symbol) -> Any:
        """``obj``'s instance attribute named by ``symbol``."""
        member = symbol.attr.rsplit(".", 1)[-1]
        try:
            return getattr(obj, member)
        except AttributeError:
            raise self.changed(
                symbol, f"is not there ({type(obj).__name__} has no {member})"
            ) from None

    def set_attribute(self, obj: Any, symbol: Symbol, value: Any) -> None:
        """Set ``obj``'s instance attribute named by ``symbol``, which it must have."""
        self.attribute(obj, symbol)
        setattr(obj, symbol.attr.rsplit(".", 1)[-1], value)

    def missing(self) -> list[str]:
        """One message for each symbol this installed version lacks (empty: all there).
        Imports the modules they live in, and nothing else."""
        problems = []
        for symbol in self.symbols:
            try:
                self.get(symbol)
            except UpstreamChanged as exc:
                problems.append(str(exc))
        return problems


_ASSIGNED = r"\bself\.{}\s*(?::[^=\n]*)?=(?!=)"


def _instances_have(cls: Any, member: str) -> bool:
    """Whether instances of ``cls`` carry ``member``: a class attribute, a declared field,
    or an assignment ``self.<member> = ...`` in one of its classes' ``__init__``."""
    import inspect

    if hasattr(cls, member):
        return True
    for klass in getattr(cls, "__mro__", ()):
        if member in getattr(klass, "__annotations__", {}):
            return True
        if member in getattr(klass, "__dataclass_fields__", {}):
            return True
        init = vars(klass).get("__init__")
        if init is None:
            continue
        try:
            source = inspect.getsource(init)
        except (OSError, TypeError):
            continue
        if re.search(_ASSIGNED.format(re.escape(member)), source):
            return True
    return False
