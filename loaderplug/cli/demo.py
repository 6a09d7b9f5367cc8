"""``loaderplug demo``: hydrate a synthetic model from a throttled test volume, then
load it in one pass.

Where FUSE is available the model sits behind the test volume set like an object-store
mount (40 MiB/s per stream, 320 MiB/s for the mount, 2 ms per request), so the report
shows range-parallel reads beating the per-stream cap. Elsewhere a plain folder stands in.
Then the one pass (torch comes with ``loaderplug[demo]``): the model's tensors handed
over as they land while the same reads hydrate a second local copy, each byte read from
the volume once, with the time to the first tensor against the whole load's.
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
            reason = f"{exc} (pip install 'loaderplug[demo]')"
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
        passed = _one_pass(mirror, backing, work / "one-pass")
        return 0 if report.ok and same and passed else 1


def _one_pass(mirror: Path, backing: Path, local: Path) -> bool:
    """Load the model's tensors from the mirror while hydrating ``local`` in the same
    reads; False if the copy or a tensor came out wrong."""
    from loaderplug.errors import LoaderplugError
    from loaderplug.tensors.format.torch_dtypes import torch_module
    from loaderplug.tensors.reader import iter_tensors

    try:
        torch_module()
    except LoaderplugError:  # torch is missing; any other failure is a bug to show
        print(
            "one pass (tensors as they land, the copy in the same reads): needs torch "
            "(pip install 'loaderplug[demo]')"
        )
        return True
    shards = sorted(mirror.glob("*.safetensors"))
    print(f"one pass: {len(shards)} shards' tensors as they land, hydrating {local} too:")
    load = iter_tensors(shards, local_dir=local, progress=False)
    count = nbytes = 0
    for _name, tensor in load:
        count += 1
        nbytes += tensor.numel() * tensor.element_size()
    report = load.report
    assert report is not None
    print(f"{count} tensors ({nbytes >> 20} MiB) at {report.mib_per_s:.1f} MiB/s; "
          f"{len(report.restored)} files restored, {len(report.failed)} failed")  # fmt: skip
    print(_first_against_whole(load.first_tensor_s, report.seconds))
    same = all(filecmp.cmp(backing / s.name, local / s.name, shallow=False) for s in shards)
    print("one-pass copy byte-identical to the mirror:", "yes" if same else "NO")
    return report.ok and same


def _first_against_whole(first_s: float | None, whole_s: float) -> str:
    """The one pass's point, in a line: the consumer has its first tensor long before the
    load is over (both timed from the job's start, its files listed)."""
    if first_s is None:
        return f"no tensor handed over; whole load {whole_s:.2f} s"
    share = first_s / whole_s if whole_s > 0 else 1.0
    return (
        f"first tensor after {first_s:.2f} s, whole load {whole_s:.2f} s "
        f"(the first {share:.0%} of the way into the load)"
    )
