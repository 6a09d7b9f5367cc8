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
revisions and refs, its info and file listings, a file's metadata (the ``HEAD`` of a
``/resolve/`` URL). A file's content (the ``GET`` of that URL; Xet transfers go to
other hosts) and every write (a commit, an upload) go as stock sends them, whatever
the outage: their timeouts are their callers', a slow transfer is no outage, and the
mirror could answer neither. Requests for repos the mirror does not hold go as stock
sends them too: a first worker's download is never cut short here.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from .hub_commits import outage, recent_outage

# After a repo's owner and name in an API path: what the request asks of the repo, so
# a one-part repo id (``gpt2``) is told from the owner of a two-part one.
_API_VERBS = frozenset(
    ("revision", "tree", "paths-info", "treesize", "preupload", "commit", "commits", "refs",
     "branch", "tag", "xet-read-token", "lfs-files", "discussions", "settings", "resolve",
     "compare", "parquet")
)  # fmt: skip
_API = re.compile(r"^/api/(models|datasets|spaces)/(.+)$")
_FILE = re.compile(r"^/(?:(datasets|spaces)/)?(.+?)/resolve/")
# A file's URL, as huggingface_hub builds it (hf_hub_url) or as its API serves it too
# (/api/models/<repo>/resolve/...): a GET of it is the file's content.
_FILE_CONTENT = re.compile(r"^(?:/api/(?:models|datasets|spaces))?/.+?/resolve/")
# The one request huggingface_hub POSTs to read a repo (get_paths_info); every other
# POST, and every PUT, PATCH or DELETE, writes.
_READING_POST = re.compile(r"^/api/(?:models|datasets|spaces)/.+/paths-info/")

# Whether the mirror holds a repo: (repo type, repo id) -> bool.
Holds = Callable[[str, str], bool]


def repo_of(path: str) -> tuple[str, str] | None:
    """The repo type and id a Hub request is about, from its URL path; None for another
    request (a redirect target, a login)."""
    api = _API.match(path)
    if api is not None:
        parts = api.group(2).split("/")
        one_part = len(parts) == 1 or parts[1] in _API_VERBS
        return api.group(1).rstrip("s"), parts[0] if one_part else "/".join(parts[:2])
    file = _FILE.match(path)
    if file is not None:
        return (file.group(1) or "models").rstrip("s"), file.group(2)
    return None


def asks_about(method: str, path: str) -> tuple[str, str] | None:
    """The repo (type and id) a request asks the Hub about, from its method and URL
    path; None for one that moves a file's content (a download's GET, an upload, a
    commit) or is about no repo."""
    method = method.upper()
    if method == "GET" and _FILE_CONTENT.match(path):
        return None
    if method not in ("GET", "HEAD") and not (method == "POST" and _READING_POST.match(path)):
        return None
    return repo_of(path)


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
        repo = asks_about(request.method, request.url.path)
        if repo is None or not holds(*repo):
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
