"""A Hub that is down, failing or hung costs a process one timeout, not one per request.

Stock huggingface_hub sends its API requests with no timeout (transformers'
``from_pretrained`` waited in ``model_info`` for as long as it was let, on a Hub that
accepted connections and never answered) and retries a refused connection or a 5xx
for some 23 s per request. With the Hub hook on, the requests for a repo the mirror
holds are guarded (:func:`guard`):

* one that has no timeout of its own waits at most ``LOADERPLUG_HUB_TIMEOUT_S`` for the
  connection and for each read;
* a timeout, a refused connection, a 5xx or a 429 marks the Hub out of reach (the
  outage :mod:`.hub_commits` keeps, so the commit pins agree) for ``OUTAGE_S``;
* meanwhile a request for such a repo fails at once with huggingface_hub's
  ``OfflineModeIsEnabled``, which huggingface_hub, transformers and vLLM take as
  ``HF_HUB_OFFLINE``: they look in the local cache, where the hook serves the mirror.

Only what a worker asks the Hub *about* a repo is guarded (:func:`asks_about`): its
revisions and refs, its info and file listings, a file's metadata (the ``HEAD`` of its
URL, ``/{repo}/resolve/{revision}/{filename}``, known by that shape, not by a
``/resolve/`` anywhere in it: a folder or a repo may be named ``resolve``). A file's
content (the ``GET`` of that URL; Xet transfers go to other hosts) and every write (a
commit, an upload) go as stock sends them, whatever the outage: their timeouts are
their callers', a slow transfer is no outage, and the mirror could answer neither.
Requests for repos the mirror does not hold go as stock sends them too: a first
worker's download is never cut short here.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loaderplug.integrations.hub.commits import outage, recent_outage

# What an API path asks of a repo, after its id: each verb with the fewest and the most
# path segments that follow it (None: any number). The counts tell a one-part repo id
# (``gpt2/revision/main``) from the owner of a two-part one (``org/resolve/revision/main``),
# and a revision such as ``refs/pr/1`` (a path's ``%2F`` arrive decoded) from the
# ``refs`` verb, which takes nothing.
_API_VERBS: dict[str, tuple[int, int | None]] = {
    "resolve": (2, None), "revision": (1, None), "tree": (1, None),
    "paths-info": (1, None), "treesize": (1, None), "preupload": (1, None),
    "commit": (1, None), "commits": (1, None), "refs": (0, 0), "branch": (1, None),
    "tag": (1, None), "xet-read-token": (1, None), "lfs-files": (0, None),
    "discussions": (0, None), "settings": (0, 0), "compare": (1, None),
    "parquet": (0, None),
}  # fmt: skip
_API = re.compile(r"^/api/(models|datasets|spaces)/(.+)$")
# A file's URL as huggingface_hub builds it (hf_hub_url): /[datasets/|spaces/]{repo}/
# resolve/{revision}/{filename}, the repo id of one part or two.
_FILE = re.compile(r"^/(?:(datasets|spaces)/)?(.+)$")

# Whether the mirror holds a repo: (repo type, repo id) -> bool.
Holds = Callable[[str, str], bool]


@dataclass(frozen=True)
class _Reading:
    """One way to read a Hub URL path: the repo it names and the verb after the repo
    (``resolve`` for a file's URL, None for the repo's info, or a verb unknown here)."""

    repo: tuple[str, str]
    verb: str | None


def _readings(path: str) -> list[_Reading]:
    """Every reading of a URL path its shape allows, the likelier first: a two-part repo
    id before a one-part one (few repos have no owner). Several readings remain only for
    a repo or revision named like a verb (``org/resolve/resolve/main/f``)."""
    api = _API.match(path)
    if api is not None:
        repo_type, parts = api.group(1).rstrip("s"), api.group(2).split("/")
        readings = [
            _Reading((repo_type, "/".join(parts[:n])), parts[n] if len(parts) > n else None)
            for n in (2, 1)
            if _api_verb_fits(parts, n)
        ]
        if not readings and len(parts) > 2:  # a verb unknown here: most repos have owners
            readings.append(_Reading((repo_type, "/".join(parts[:2])), None))
        return readings
    file = _FILE.match(path) if not path.startswith("/api/") else None
    if file is None:
        return []
    repo_type, parts = (file.group(1) or "models").rstrip("s"), file.group(2).split("/")
    return [
        _Reading((repo_type, "/".join(parts[:n])), "resolve")
        for n in (2, 1)
        if len(parts) >= n + 3 and parts[n] == "resolve" and all(parts[: n + 3])
    ]


def _api_verb_fits(parts: list[str], n: int) -> bool:
    """Whether an API path's segments ``parts`` read as a repo id of ``n`` parts, then
    nothing or a known verb and as many segments as that verb takes."""
    if len(parts) < n or not all(parts[:n]):
        return False
    if len(parts) == n:
        return True
    fewest, most = _API_VERBS.get(parts[n], (-1, -1))
    after = len(parts) - n - 1
    return 0 <= fewest <= after and (most is None or after <= most)


def repo_of(path: str) -> tuple[str, str] | None:
    """The repo type and id a Hub request is about, from its URL path (the likelier
    reading where its shape allows several); None for another request (a redirect
    target, a login)."""
    readings = _readings(path)
    return readings[0].repo if readings else None


def asks_about(method: str, path: str, holds: Holds | None = None) -> tuple[str, str] | None:
    """The repo (type and id) a request asks the Hub about, from its method and URL
    path; None for one that moves a file's content (a download's GET, an upload, a
    commit) or is about no repo. Where the path reads several ways, ``holds`` (whether
    the mirror holds a repo) picks the first reading about a repo the mirror holds."""
    method = method.upper()
    readings = [(reading, _asked(method, reading)) for reading in _readings(path)]
    if not any(repo for _, repo in readings):
        return None  # the mirror is not looked at for a download or an upload
    for reading, repo in readings:
        if holds is None or holds(*reading.repo):
            return repo
    return None


def _asked(method: str, reading: _Reading) -> tuple[str, str] | None:
    """The repo a request asks about, if its path reads as ``reading``."""
    if reading.verb == "resolve":  # a file's URL: its GET is the content, its HEAD asks
        return reading.repo if method == "HEAD" else None
    # The one request huggingface_hub POSTs to read a repo is get_paths_info; every
    # other POST, and every PUT, PATCH or DELETE, writes.
    if method in ("GET", "HEAD") or (method == "POST" and reading.verb == "paths-info"):
        return reading.repo
    return None


def guard(
    client: Any,
    holds: Holds,
    timeout_s: float,
    offline_error: type[Exception],
    unreachable: tuple[type[BaseException], ...],
) -> Any:
    """``client`` (huggingface_hub's ``httpx2.Client``), the requests it sends about repos
    the mirror holds guarded as the module doc says; ``offline_error``: huggingface_hub's
    ``OfflineModeIsEnabled``; ``unreachable``: what the client raises for a refused or
    failed connection and for a timeout."""
    send = client.send

    @functools.wraps(send)
    def guarded_send(request: Any, *args: Any, **kwargs: Any) -> Any:
        repo = asks_about(request.method, request.url.path, holds)
        if repo is None:
            return send(request, *args, **kwargs)
        endpoint = f"{request.url.scheme}://{request.url.netloc.decode()}"
        down = recent_outage(endpoint)
        if down:
            raise offline_error(f"{down}; {repo[1]} is served from the loaderplug mirror")
        _bound(request, timeout_s)
        try:
            response = send(request, *args, **kwargs)
        except unreachable as exc:
            outage(endpoint, exc)
            raise
        if response.status_code >= 500 or response.status_code == 429:
            outage(endpoint, RuntimeError(f"it answered {response.status_code}"))
        return response

    client.send = guarded_send
    return client


def _bound(request: Any, timeout_s: float) -> None:
    """Give the request's unbounded waits (connect, read, write, pool) ``timeout_s``."""
    timeouts = request.extensions.get("timeout")
    if isinstance(timeouts, dict):
        request.extensions["timeout"] = {
            k: timeout_s if v is None else v for k, v in timeouts.items()
        }
