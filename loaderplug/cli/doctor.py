"""``loaderplug doctor``: how each path would be read, and where each setting came from."""

from __future__ import annotations

import os
from collections.abc import Sequence

from loaderplug.plugins.manager import Plugins
from loaderplug.settings import REGISTRY, from_env
from loaderplug.storage.mounts import find_mount
from loaderplug.units import format_size


def doctor(paths: Sequence[str], environ: dict[str, str] | None = None) -> str:
    settings = from_env(environ if environ is not None else os.environ)
    plugins = Plugins(settings)
    lines = []
    for path in paths:
        policy = plugins.io_policy(path)
        mount = find_mount(path)
        where = f" on {mount.mount_point} ({mount.source})" if mount else ""
        mode = f"direct, {policy.alignment}-byte aligned" if policy.direct else "buffered"
        missing = "" if os.path.exists(path) else " (does not exist yet; decided for its folder)"
        lines.append(
            f"{path}{missing}: {policy.fs_type}{where}: {mode}: {policy.reason}; "
            f"{policy.inode_note}"
        )
    lines.append("settings:")
    for var in REGISTRY:
        value = getattr(settings, var.field)
        shown = format_size(value) if var.kind == "size" and value is not None else value
        lines.append(f"  {var.name}={shown}  ({settings.origins.get(var.field, 'default')})")
    return "\n".join(lines)
