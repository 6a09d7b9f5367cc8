"""``loaderplug run [--] COMMAND [ARGS...]``: COMMAND with the Hub hook on in every
Python process it starts, the program and its children, with no change to it.

As ``opentelemetry-instrument`` or ``ddtrace-run`` do, it puts a folder holding a
``sitecustomize`` first on ``PYTHONPATH`` (see
``loaderplug/integrations/bootstrap/sitecustomize.py``: the program's own
``sitecustomize`` still runs) and then becomes COMMAND (``exec``): its exit status,
standard streams and signals are the program's own. A process that never imports
``huggingface_hub`` pays only for that file.

Before that, once: the settings must parse, ``huggingface_hub`` must be importable and
a mirror must be configured (``LOADERPLUG_MIRROR``, or a plugin's). Where one is not so,
it says why in one line and runs COMMAND exactly as it would run without loaderplug.
A COMMAND that cannot be found gets one line and exit status 127 (126: found, not
runnable), as from a shell.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from loaderplug.errors import LoaderplugError
from loaderplug.plugins.manager import Plugins
from loaderplug.settings import from_env
from loaderplug.storage.object_urls import ObjectURL, is_object_url
from loaderplug.types import MirrorRequest

BOOTSTRAP = Path(__file__).resolve().parent.parent / "integrations" / "bootstrap"
EXIT_NOT_FOUND = 127
EXIT_NOT_RUNNABLE = 126


def run_command(command: Sequence[str]) -> int:
    """Become ``command`` with the hook on (or, said why, without it); returns only
    when it cannot be started."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("loaderplug run: name a command to run: loaderplug run [--] COMMAND [ARGS...]",
              file=sys.stderr)  # fmt: skip
        return 2
    program = shutil.which(command[0])
    if program is None:
        print(f"loaderplug run: {command[0]}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    env = dict(os.environ)
    why_not = hook_unavailable()
    if why_not is None:
        env["PYTHONPATH"] = with_bootstrap(env.get("PYTHONPATH"))
    else:
        print(f"loaderplug run: the Hub hook is off ({why_not}); running {command[0]} "
              f"without it", file=sys.stderr)  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(program, list(command), env)
    except OSError as exc:
        print(f"loaderplug run: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
    return EXIT_NOT_RUNNABLE


def hook_unavailable() -> str | None:
    """Why the Hub hook cannot be on in the processes to come, or None if it can."""
    try:
        settings = from_env()
    except LoaderplugError as exc:
        return str(exc)
    if importlib.util.find_spec("huggingface_hub") is None:
        return "huggingface_hub is not installed: pip install 'loaderplug[hf]'"
    if settings.mirror and is_object_url(settings.mirror):
        try:  # a bucket: its URL is checked here, its objects at each download
            ObjectURL.parse(settings.mirror, variable="LOADERPLUG_MIRROR")
        except LoaderplugError as exc:
            return str(exc)
        return None
    try:
        mirror = Plugins(settings).find_mirror(MirrorRequest("hub", "any/repo"))
    except LoaderplugError as exc:
        return str(exc)
    if mirror is None:
        if not settings.mirror:
            return "no mirror to serve from: set LOADERPLUG_MIRROR to the volume's folder"
        return f"no mirror to serve from: LOADERPLUG_MIRROR={settings.mirror} is not a folder"
    return None


def with_bootstrap(pythonpath: str | None) -> str:
    """``PYTHONPATH`` with the bootstrap folder first (once), the rest as it was."""
    rest = [p for p in (pythonpath or "").split(os.pathsep) if p and p != str(BOOTSTRAP)]
    return os.pathsep.join([str(BOOTSTRAP), *rest])
