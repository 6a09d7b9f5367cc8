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

Requests for repos the mirror does not hold go to the Hub as stock sends them: a first
worker's download is never cut short here.
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


def guard(
    client: Any,
    holds: Holds,
    timeout_s: float,
    offline_error: type[Exception],
    unreachable: tuple[type[BaseException], ...],
) -> Any:
    """``client`` (huggingface_hub's ``httpx2.Client``), its requests for repos the mirror
    holds guarded as the module doc says; ``offline_error``: huggingface_hub's
    ``OfflineModeIsEnabled``; ``unreachable``: what the client raises for a refused or
    failed connection and for a timeout."""
    send = client.send

    @functools.wraps(send)
    def guarded_send(request: Any, *args: Any, **kwargs: Any) -> Any:
        repo = repo_of(request.url.path)
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
