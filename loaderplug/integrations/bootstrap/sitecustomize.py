"""Started by Python in every process that ``loaderplug run`` starts (this folder leads
``PYTHONPATH`` there): turns the Hub hook on in the process the moment it imports
``huggingface_hub``, and not before.

Python imports the first ``sitecustomize`` on its path, and this one stands in front of
the program's own: that one (the next on the path, if any) runs first, as it would
without loaderplug. Then a finder waits for ``huggingface_hub``: when the program
imports it, loaderplug's wrappers are installed right after its ``__init__`` ran, before
any of the program's modules can take a name from it. A process that never imports
``huggingface_hub`` pays for this file and one finder, nothing of loaderplug: this file
imports the standard library alone. Whatever goes wrong here is said in one line and
leaves the program as it would run without loaderplug.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing itself costs a process milliseconds to import
if TYPE_CHECKING:
    from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _run_the_programs_own() -> None:
    """The ``sitecustomize`` this one hides, run as Python would have run it."""
    # importlib.util's own import costs a process milliseconds: its function is this one.
    from importlib._bootstrap import module_from_spec
    from importlib.machinery import PathFinder

    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # as site.py reports a sitecustomize that fails
        print(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
              f"{type(exc).__name__}: {exc}", file=sys.stderr)  # fmt: skip


class _InstallAfter:
    """huggingface_hub's own loader, with loaderplug's install run once it is done."""

    def __init__(self, loader: Any, finder: _HubFinder) -> None:
        self.loader, self.finder = loader, finder

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        # The real loader back where importlib and the package's users look for it.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.finder.installed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _HubFinder:
    """Finds nothing itself: hands huggingface_hub's spec on with :class:`_InstallAfter`
    as its loader, until the package has been imported once."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "huggingface_hub":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _InstallAfter(spec.loader, self)
                return spec
        return None

    def installed(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            from loaderplug.integrations import huggingface_hub as lp_hub

            lp_hub.install()
        except Exception as exc:
            print(f"loaderplug: the Hub hook is off in this process: {exc}", file=sys.stderr)


_run_the_programs_own()
if "huggingface_hub" not in sys.modules:
    sys.meta_path.insert(0, _HubFinder())
