"""``loaderplug doctor``: how each path would be read, and where each setting came from."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

from loaderplug.plugins.manager import Plugins
from loaderplug.report import printable
from loaderplug.settings import REGISTRY, from_env
from loaderplug.storage.mounts import find_mount
from loaderplug.storage.object_source import ObjectFiles
from loaderplug.storage.object_store import describe_client
from loaderplug.storage.object_urls import ObjectURL, is_object_url, redact
from loaderplug.tensors.hosts.split import hosts_said
from loaderplug.units import MiB


def doctor(paths: Sequence[str], environ: dict[str, str] | None = None) -> str:
    # What is wrong with the settings (an unknown LOADERPLUG_* name, a renamed one) is
    # said here, a line each, rather than as Python warnings with their file paths.
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        settings = from_env(environ if environ is not None else os.environ)
    plugins = Plugins(settings)
    lines = [f"warning: {w.message}" for w in said]
    for path in paths:
        if is_object_url(path):
            lines.append(printable(_object_line(path, settings.object_timeout_s)))
            continue
        policy = plugins.io_policy(path)
        mount = find_mount(path)
        where = f" on {mount.mount_point} ({mount.source})" if mount else ""
        mode = f"direct, {policy.alignment}-byte aligned" if policy.direct else "buffered"
        missing = "" if os.path.exists(path) else " (does not exist yet; decided for its folder)"
        line = f"{path}{missing}: {policy.fs_type}{where}: {mode}: {policy.reason}; "
        lines.append(printable(line + policy.inode_note))
    lines.append(hosts_said(settings, environ if environ is not None else os.environ))
    lines.append("settings:")
    for var in REGISTRY:
        shown = redact(var.env_form(getattr(settings, var.field)))  # a URL's secrets
        lines.append(f"  {var.name}={shown}  ({settings.origins.get(var.field, 'default')})")
    return "\n".join(lines)


def _object_line(text: str, timeout_s: float) -> str:
    """How a bucket's URL would be read, and whether it answers (one listing)."""
    url = ObjectURL.parse(text, variable="PATH")
    head = f"{url}: {url.store} object store, {describe_client(url)}"
    try:
        found, refused = ObjectFiles(timeout_s).list(url)
    except OSError as exc:
        return f"{head}: not readable: {exc.strerror or exc}"
    size = sum(o.size for o in found)
    skipped = f", {len(refused)} keys refused" if refused else ""
    return (
        f"{head}: ranged GETs, each checked against the listed ETag; "
        f"{len(found)} objects, {size / MiB:.1f} MiB{skipped}"
    )
