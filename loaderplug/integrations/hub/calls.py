"""A wrapped huggingface_hub call as the Hub hook sees it: the call bound to its original's
parameters, where its repo is in the local cache and on the mirror, and which of a
commit's files it selects."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import constants

# Public (documented) API, though ``utils`` does not re-export them for type checkers.
from huggingface_hub.utils import (  # type: ignore[attr-defined]
    filter_repo_objects,
    validate_repo_id,
)

from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub.names import filename_problem, ref_problem
from loaderplug.integrations.upstream import huggingface_hub as seam
from loaderplug.plugins.manager import Plugins
from loaderplug.settings import Settings
from loaderplug.types import MirrorRequest

# Not public: see loaderplug.integrations.upstream.huggingface_hub.
repo_folder_name = seam.repo_folder_name()

# What a call that selects no file is still given: every file but the weights.
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.gguf",
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.onnx_data",
    "*.npz",
)


@dataclass(frozen=True)
class Call:
    """One download call, bound to its original's parameters; or a cache lookup, as the
    download that would have put the file in the cache (served by the mirror alone)."""

    original: Callable[..., Any]
    bound: inspect.BoundArguments
    file: str | None  # hf_hub_download's repo path; None for a snapshot
    lookup: bool = False  # a lookup asks the Hub nothing and writes nothing to the mirror

    @property
    def options(self) -> dict[str, Any]:
        return self.bound.arguments

    def run_original(self, commit: str | None = None) -> Any:
        """The original, pinned to ``commit`` where one is known (so that it downloads
        the commit the rest of the load uses, without asking the Hub again)."""
        bound = self.bound
        named = self.options.get("revision")
        if commit is not None and hub_commits.revision(self.options) != commit:
            pinned = seam.resolved_revision()(
                commit,
                named,
                self.options["repo_id"],
                self.options.get("repo_type"),
            )
            bound = inspect.BoundArguments(bound.signature, {**bound.arguments})
            bound.arguments["revision"] = pinned
        return self.original(*bound.args, **bound.kwargs)


# The repo types stock downloads take (a kernel repo where huggingface_hub knows them).
_REPO_TYPES = tuple(getattr(constants, "REPO_TYPES_WITH_KERNEL", constants.REPO_TYPES))


def unusable(options: dict[str, Any], filename: object | None = None) -> str:
    """Why the hook leaves a call to its original ("" where it may serve it): a name of
    the call that is not plainly a path inside its folder (:mod:`.hub_names`). The
    original then raises what stock raises for it, and the hook writes nothing."""
    repo_id = options.get("repo_id")
    try:
        validate_repo_id(repo_id)
    except ValueError as exc:  # HFValidationError
        return str(exc)
    if not isinstance(repo_id, str):
        return f"the repo id {repo_id!r} is not a string"
    if options.get("repo_type") not in _REPO_TYPES:
        return f"the repo type {options.get('repo_type')!r} is not one stock downloads"
    named = options.get("revision") or constants.DEFAULT_REVISION
    # A ResolvedRevision names a branch and a commit: both become paths.
    for revision in (named, getattr(named, "resolved", named)):
        problem = ref_problem(revision)
        if problem:
            return problem
    return filename_problem(filename) if filename is not None else ""


def repo_path(path: str) -> str:
    """The file's path in the repo as the Hub reads the URL that names it: without the
    ``.`` segments and empty parts (sentence-transformers asks for ``subfolder="."``)."""
    return "/".join(part for part in path.split("/") if part not in ("", "."))


def cache_folder(options: dict[str, Any]) -> Path:
    """The repo's folder in the local cache, resolved as the original resolves it."""
    cache_dir = Path(options.get("cache_dir") or constants.HF_HUB_CACHE).expanduser().resolve()
    name = repo_folder_name(repo_id=options["repo_id"], repo_type=hub_commits.repo_type(options))
    return cache_dir / name


def mirror_for(options: dict[str, Any], settings: Settings) -> Path | None:
    """The mirror's folder for this repo (``<hub root>/models--org--name``), or None,
    also when the local cache is the mirror itself (``HF_HOME`` on the volume)."""
    request = MirrorRequest("hub", options["repo_id"], hub_commits.revision(options))
    root = Plugins(settings).find_mirror(request)
    if root is None:
        return None
    name = repo_folder_name(repo_id=options["repo_id"], repo_type=hub_commits.repo_type(options))
    mirror = root / name
    if options.get("local_dir") is None and mirror.resolve() == cache_folder(options):
        return None
    return mirror


def wanted(paths: Iterable[str], options: dict[str, Any]) -> list[str]:
    """The repo paths the call's allow/ignore patterns select."""
    return list(
        filter_repo_objects(
            items=list(paths),
            allow_patterns=options.get("allow_patterns"),
            ignore_patterns=options.get("ignore_patterns"),
        )
    )


def chooser(call: Call) -> Callable[[Iterable[str]], list[str]]:
    """The repo paths a call asks the mirror for, out of a commit's paths."""
    if call.file is not None:
        file = call.file
        return lambda paths: [file] if file in set(paths) else []

    def choose(paths: Iterable[str]) -> list[str]:
        paths = list(paths)
        chosen = wanted(paths, call.options)
        if chosen or call.options.get("local_dir") is not None:
            return chosen
        # A lookup of the snapshot's path alone (vLLM's, offline: ignore_patterns="*")
        # gets a snapshot a loader can use: its files other than weights.
        return list(filter_repo_objects(items=paths, ignore_patterns=list(WEIGHT_PATTERNS)))

    return choose
