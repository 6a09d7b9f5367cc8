"""IO policy from the filesystem type (the full matrix belongs to the reader)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loaderplug import io_policy
from loaderplug.storage.mounts import Mount, find_mount, is_buffered_type, read_mounts
from tests.conftest import drop_from_page_cache


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


MOUNTINFO = """\
27 1 254:0 / / rw - ext4 /dev/vda rw
40 27 0:40 / /net rw - autofs systemd-1 rw
41 40 0:41 / /net/store rw - nfs4 store:/export rw
50 27 259:1 / /mnt/nvme rw - xfs /dev/nvme0n1p1 rw
60 27 0:60 / /models rw - fuse.s3fs s3fs rw
61 27 0:61 / /cache rw - fuse.juicefs JuiceFS:x rw
62 27 0:62 / /vol rw - ext4 /dev/vdc rw
63 62 0:63 / /vol rw - fuse.geesefs bucket rw
64 27 0:64 / /lustre rw - lustre 10.0.0.1@tcp:/fs rw
65 27 0:65 / /scratch rw - btrfs /dev/sdb rw
"""


@pytest.mark.parametrize(
    ("path", "fs_type", "buffered"),
    [
        ("/net/store/llama/model.safetensors", "nfs4", True),  # NFS under autofs
        ("/net/other", "autofs", False),
        ("/mnt/nvme/m", "xfs", False),
        ("/models/m", "fuse.s3fs", True),
        ("/cache/m", "fuse.juicefs", True),
        ("/vol/m", "fuse.geesefs", True),  # a FUSE mount stacked on ext4: the top one wins
        ("/lustre/m", "lustre", True),
        ("/scratch/m", "btrfs", False),
        ("/home/m", "ext4", False),
    ],
)
def test_policy_table_from_mountinfo(
    tmp_path: Path, path: str, fs_type: str, buffered: bool
) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    mount = find_mount(path, read_mounts(str(info)))
    assert mount is not None and mount.fs_type == fs_type
    assert is_buffered_type(fs_type) is buffered


def test_tmpfs_is_read_buffered_and_says_why() -> None:
    policy = io_policy("/dev/shm")
    assert not policy.direct and "lives in memory" in policy.reason


def test_local_alignment_comes_from_the_kernel(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    drop_from_page_cache(tmp_path / "f")  # a warm file is read buffered, with no alignment
    policy = io_policy(str(tmp_path / "f"))
    if not policy.direct:
        pytest.skip(
            f"{policy.fs_type} here is not read direct, so has no alignment: {policy.reason}"
        )
    assert policy.alignment >= 512 and policy.alignment & (policy.alignment - 1) == 0


def test_a_warm_local_file_is_read_from_the_page_cache_and_a_cold_one_direct(
    tmp_path: Path,
) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cold = io_policy(str(path))
        os.pread(fd, 1 << 20, 0)
        warm = io_policy(str(path))
    finally:
        os.close(fd)
    if not cold.direct:
        pytest.skip(f"{cold.fs_type} here is not read direct: {cold.reason}")
    assert not warm.direct and "in the page cache" in warm.reason
