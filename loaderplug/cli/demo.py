"""``loaderplug demo``: hydrate a synthetic model from a throttled test volume.

Where FUSE is available the model sits behind the test volume set like an object-store
mount (40 MiB/s per stream, 320 MiB/s for the mount, 2 ms per request), so the report
shows range-parallel reads beating the per-stream cap. Elsewhere a plain folder stands in.
"""

from __future__ import annotations

import filecmp
import tempfile
from contextlib import ExitStack
from pathlib import Path

from loaderplug.jobs.copies import hydrate
from loaderplug.testing.model import write_model


def run_demo(size_mib: int = 256, shards: int = 4) -> int:
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="loaderplug-demo-")))
        backing, local = work / "volume", work / "local"
        print(f"writing a {size_mib} MiB, {shards}-shard synthetic model ...")
        write_model(backing, size_mib << 20, shards)
        mirror = backing
        try:
            from loaderplug.testing.volume import VolumeProfile, fuse_unavailable_reason, mounted

            reason = fuse_unavailable_reason()
        except ImportError as exc:
            reason = f"{exc} (pip install 'loaderplug[test]')"
        if reason is None:
            profile = VolumeProfile.object_store()
            mirror = stack.enter_context(mounted(backing, work / "mnt", profile)).mountpoint
            print(
                f"mirror: FUSE test volume at {mirror} (40 MiB/s per stream, "
                f"320 MiB/s for the mount, 2 ms per request)"
            )
        else:
            print(f"mirror: plain folder {mirror} (no throttled volume: {reason})")
        report = hydrate(mirror, local, check=False)
        print(report.summary())
        same = all(
            filecmp.cmp(backing / r.path, local / r.path, shallow=False) for r in report.restored
        )
        print("restored files byte-identical to the mirror:", "yes" if same else "NO")
        print("a second hydrate is a no-op:")
        print(hydrate(mirror, local, check=False).summary())
        return 0 if report.ok and same else 1
