"""Run ``loaderplug`` with every read slowed down, so a test can interrupt it mid-copy.

Usage: python slow_hydrate.py DELAY_S loaderplug-args...
The delay comes from a plugin on the ``loaderplug_open_source`` hook, the same seam a
third-party backend would use.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time

from loaderplug.plugins import manager as plugins
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.storage.source import PosixSource
from loaderplug.types import IOPolicy


class SlowSource(PosixSource):
    def pread_into(self, buf: memoryview, offset: int) -> int:
        if READ_LOG:  # a line per read started (offset, bytes asked, file), to count
            with open(READ_LOG, "a") as log:
                log.write(f"{offset} {len(buf)} {self.path}\n")
        time.sleep(DELAY_S)
        return super().pread_into(buf, offset)


class SlowPlugin:
    @hookimpl
    def loaderplug_open_source(self, path: str, policy: IOPolicy) -> SlowSource:
        return SlowSource(path, policy)


# As in a terminal: Ctrl-C interrupts. A test run started in the background by a shell
# (`pytest ... &`) ignores SIGINT, and its children inherit that.
signal.signal(signal.SIGINT, signal.default_int_handler)
DELAY_S = float(sys.argv[1])
READ_LOG = os.environ.get("SLOW_HYDRATE_READ_LOG", "")
plugins.register(SlowPlugin())
# The command itself, as `python -m loaderplug ARGS` runs it, in this process.
sys.argv = ["loaderplug", *sys.argv[2:]]
runpy.run_module("loaderplug", run_name="__main__", alter_sys=True)
