"""IO policy from the filesystem type (the full matrix belongs to the reader)."""

from __future__ import annotations

from pathlib import Path

from loaderplug import io_policy
from loaderplug.fs import Mount, find_mount, is_buffered_type, read_mounts


def test_stacked_mounts_the_last_one_wins(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "27 1 254:0 / / rw - ext4 /dev/vda rw\n"
        "50 27 0:50 / /mnt/models rw - ext4 /dev/vdb rw\n"
        "51 50 0:51 / /mnt/models rw - fuse.geesefs bucket rw\n"
        "52 27 0:52 / /mnt/with\\040space rw - nfs4 host:/x rw\n"
    )
    mounts = read_mounts(str(info))
    assert mounts[-1] == Mount("/mnt/with space", "nfs4", "host:/x")
    assert find_mount("/mnt/models/a.safetensors", mounts).fs_type == "fuse.geesefs"  # type: ignore[union-attr]
    assert find_mount("/mnt/modelsX", mounts).fs_type == "ext4"  # type: ignore[union-attr]


def test_network_and_fuse_types_are_buffered() -> None:
    for t in ("nfs", "nfs4", "cifs", "lustre", "fuse", "fuse.geesefs", "fuse.s3fs", "tmpfs"):
        assert is_buffered_type(t), t
    for t in ("ext4", "xfs", "btrfs", "f2fs"):
        assert not is_buffered_type(t), t


def test_io_policy_on_this_machine(tmp_path: Path) -> None:
    assert not io_policy("/dev/shm").direct
    assert io_policy(str(tmp_path), direct_io="off").direct is False
    forced = io_policy("/dev/shm", direct_io="on")
    assert forced.direct and forced.reason == "LOADERPLUG_DIRECT_IO=on"
