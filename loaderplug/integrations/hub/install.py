"""The Hub hook put in place: each wrapper bound wherever a library can reach the
original it replaces, and huggingface_hub's HTTP client guarded (:mod:`.hub_outage`:
what it asks about a repo, never a download or an upload); all of it undone by
:func:`uninstall`."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import huggingface_hub

from loaderplug.integrations.hub import outage as hub_outage
from loaderplug.integrations.hub.bucket import bucket_holds
from loaderplug.integrations.hub.calls import mirror_for
from loaderplug.integrations.upstream import huggingface_hub as seam
from loaderplug.settings import from_env
from loaderplug.storage.object_urls import ObjectURL, is_object_url

# (module, name, original) for every name rebound, to put back.
_installed: list[tuple[types.ModuleType, str, Callable[..., Any]]] = []
_factories: list[Callable[[], Any]] = []  # the client factory the guard wraps

# References that stay the originals: huggingface_hub's snapshot module calls
# hf_hub_download once per file it fetches, and its local_dir download looks in the
# cache with try_to_load_from_cache; both are inside a call already routed here.
_KEEP_ORIGINAL = {
    ("huggingface_hub._snapshot_download", "hf_hub_download"),
    ("huggingface_hub.file_download", "try_to_load_from_cache"),
}


def install(ours: dict[Callable[..., Any], Callable[..., Any]], owner: types.ModuleType) -> None:
    """Bind each wrapper of ``ours`` (original -> wrapper) in every namespace holding its
    original, but ``owner``'s (whose references to the originals stay), and guard the
    client. Idempotent."""
    if _installed:
        return
    _guard_the_client()
    for original in ours:
        getattr(huggingface_hub, original.__name__)  # resolve the lazy attributes first
    for module in list(sys.modules.values()):
        if module is owner:
            continue
        for name, original in _names_holding_originals(module, ours):
            if (module.__name__, name) in _KEEP_ORIGINAL:
                continue
            setattr(module, name, ours[original])
            _installed.append((module, name, original))
    for original, wrapper in ours.items():
        if getattr(huggingface_hub, original.__name__) is not wrapper:
            setattr(huggingface_hub, original.__name__, wrapper)
            _installed.append((huggingface_hub, original.__name__, original))


def _guard_the_client() -> None:
    """huggingface_hub's shared client from now on: made by the factory in place (its
    default, or the program's own), what it asks about repos the mirror holds guarded
    (a file's content and an upload are sent as the factory's client sends them)."""
    made_by = seam.client_factory()

    def guarded() -> Any:
        timeout_s = from_env().hub_timeout_s
        unreachable = seam.unreachable_errors()[:2]  # the connection's and the timeout's
        return hub_outage.guard(
            made_by(), _mirror_holds, timeout_s, seam.offline_mode_error(), unreachable
        )

    seam.set_client_factory()(guarded)  # the shared client in use so far is closed
    _factories.append(made_by)


def _mirror_holds(repo_type: str, repo_id: str) -> bool:
    """Whether the mirror holds the repo (some commit of it), so that a Hub out of reach
    is no reason to wait."""
    try:
        settings = from_env()
        if settings.mirror and is_object_url(settings.mirror):
            return bucket_holds(ObjectURL.parse(settings.mirror), repo_type, repo_id)
        mirror = mirror_for({"repo_id": repo_id, "repo_type": repo_type}, settings)
    except Exception:  # a bad setting is said where it matters: at the download
        return False
    return mirror is not None and (mirror / "refs").is_dir()


def _names_holding_originals(
    module: Any, originals: dict[Callable[..., Any], Callable[..., Any]]
) -> list[tuple[str, Callable[..., Any]]]:
    """The names in ``module`` bound to one of ``originals``, compared by identity: a
    module's values may be lazy objects that import things when hashed or compared."""
    try:
        namespace = vars(module)
    except TypeError:
        return []
    by_id = {id(original): original for original in originals}
    return [
        (name, by_id[id(value)]) for name, value in list(namespace.items()) if id(value) in by_id
    ]


def uninstall(wrappers: set[Callable[..., Any]]) -> None:
    """Put the originals back wherever :func:`install` replaced them with ``wrappers``."""
    while _factories:
        seam.set_client_factory()(_factories.pop())
    while _installed:
        module, name, original = _installed.pop()
        if getattr(module, name, None) in wrappers:
            setattr(module, name, original)


def is_installed() -> bool:
    return bool(_installed)
