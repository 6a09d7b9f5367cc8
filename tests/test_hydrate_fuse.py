"""Hydrate from the FUSE test volume: a real, slow, faulty network mount."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from loaderplug import hydrate, io_policy
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import (
    Fault,
    Replace,
    TestVolume,
    VolumeProfile,
    mounted,
)
from loaderplug.units import MiB
from tests.conftest import FAST, leftover_temps, tree_bytes

pytestmark = pytest.mark.fuse
SHARD2 = "model-00002-of-00004.safetensors"


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    folder = tmp_path / "backing"
    write_model(folder, 4 * MiB, shards=4)
    return folder


@pytest.fixture
def volume(backing: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[TestVolume]:
    profile = getattr(request, "param", VolumeProfile(per_stream_bytes_per_s=64 * MiB))
    (tmp_path / "mnt").mkdir()
    with mounted(backing, tmp_path / "mnt", profile) as vol:
        yield vol


def test_a_fuse_mirror_is_read_buffered(volume: TestVolume) -> None:
    policy = io_policy(str(volume.mountpoint / SHARD2))
    assert policy.fs_type.startswith("fuse.") and not policy.direct


@pytest.mark.parametrize(
    "volume",
    # Throttled streams keep reads in flight at once, as under real load.
    [VolumeProfile(per_stream_bytes_per_s=16 * MiB, faults=(Fault(errno.ENOMEM, max_inflight=3),))],
    indirect=True,
)
def test_enomem_storm_under_load_is_retried_and_bytes_are_identical(
    volume: TestVolume, backing: Path, tmp_path: Path
) -> None:
    # Six workers against a volume that refuses more than three reads at once: jittered
    # backoff spreads the retries out until every range gets through.
    settings = {
        **FAST,
        "readers": 6,
        "retry_base_ms": 20,
        "retry_max_ms": 300,
        "retry_attempts": 12,
    }
    report = hydrate(volume.mountpoint, tmp_path / "local", **settings)
    assert volume.stats()["faults_injected"] > 0
    assert report.retries > 0 and report.ok
    assert tree_bytes(tmp_path / "local") == tree_bytes(backing)


@pytest.mark.slow("drives a FUSE test volume into ENOMEM and back")
def test_auto_workers_back_off_below_the_in_flight_count_that_draws_enomem(
    tmp_path: Path,
) -> None:
    # Auto starts at AUTO_START_WORKERS (16) readers; the volume refuses more than three
    # reads at once.
    backing = tmp_path / "big"
    write_model(backing, 96 * MiB, shards=2)
    profile = VolumeProfile(
        per_stream_bytes_per_s=16 * MiB, faults=(Fault(errno.ENOMEM, max_inflight=3),)
    )
    (tmp_path / "mnt").mkdir()
    with mounted(backing, tmp_path / "mnt", profile) as vol:
        report = hydrate(vol.mountpoint, tmp_path / "local", **{**FAST, "readers": "auto"})
        assert vol.stats()["faults_injected"] > 0
    assert report.ok and report.retries > 0
    assert report.readers_range is not None and report.readers_range[0] <= 4
    assert "(auto, " in report.summary(), report.summary()
    assert tree_bytes(tmp_path / "local") == tree_bytes(backing)


@pytest.mark.parametrize(
    "volume",
    [
        VolumeProfile(
            faults=(
                Fault(errno.EIO, path_glob=SHARD2, limit=5),
                Fault(errno.EAGAIN, path_glob="config.json", limit=2),
            )
        )
    ],
    indirect=True,
)
def test_counted_transient_faults_are_retried(
    volume: TestVolume, backing: Path, tmp_path: Path
) -> None:
    report = hydrate(volume.mountpoint, tmp_path / "local", **FAST)
    assert volume.stats()["faults_injected"] == 7
    assert report.ok and report.retries >= 1
    assert tree_bytes(tmp_path / "local") == tree_bytes(backing)


@pytest.mark.parametrize(
    "volume",
    [VolumeProfile(faults=(Fault(errno.EACCES, path_glob=SHARD2, after_bytes=MiB // 2),))],
    indirect=True,
)
def test_a_non_transient_fault_fails_that_file_only(
    volume: TestVolume, backing: Path, tmp_path: Path
) -> None:
    report = hydrate(volume.mountpoint, tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == [SHARD2]
    assert report.failed[0].errno == errno.EACCES
    local = tree_bytes(tmp_path / "local")
    assert SHARD2 not in local and len(local) == 5
    assert leftover_temps(tmp_path / "local") == []


def replaced_volume(backing: Path, tmp_path: Path, new_bytes: bytes) -> VolumeProfile:
    staged = tmp_path / "staged.bin"
    staged.write_bytes(new_bytes)
    return VolumeProfile(
        per_stream_bytes_per_s=16 * MiB,
        replace=(Replace(SHARD2, after_bytes=256 * 1024, with_file=str(staged)),),
    )


@pytest.mark.parametrize("new_size", ["same", "truncated"])
def test_a_source_replaced_mid_hydrate_is_refused(
    backing: Path, tmp_path: Path, new_size: str
) -> None:
    original = (backing / SHARD2).read_bytes()
    new = bytes(len(original)) if new_size == "same" else original[: len(original) // 3]
    (tmp_path / "mnt").mkdir()
    local = tmp_path / "local"
    local.mkdir()
    # An older good copy is already local: a refused update must not touch it.
    (local / SHARD2).write_bytes(b"older good copy")
    with mounted(backing, tmp_path / "mnt", replaced_volume(backing, tmp_path, new)) as vol:
        report = hydrate(vol.mountpoint, local, check=False, **FAST)
        assert vol.stats()["replacements"] == 1
    assert [r.path for r in report.failed] == [SHARD2]
    assert "source changed while being copied" in report.failed[0].reason
    assert (local / SHARD2).read_bytes() == b"older good copy"
    assert leftover_temps(local) == []
    assert len(report.restored) == 5


def test_a_mirror_file_truncated_after_sync_is_refused(backing: Path, tmp_path: Path) -> None:
    from loaderplug import sync

    mirror_backing = tmp_path / "mirror-backing"
    sync(backing, mirror_backing, **FAST)
    shard = mirror_backing / SHARD2
    shard.write_bytes(shard.read_bytes()[:1000])  # an interrupted upload
    (tmp_path / "mnt").mkdir()
    with mounted(mirror_backing, tmp_path / "mnt") as vol:
        report = hydrate(vol.mountpoint, tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == [SHARD2]
    assert "changed since the mirror's manifest was written" in report.failed[0].reason
    assert not (tmp_path / "local" / SHARD2).exists()


def test_sync_to_a_fuse_mirror_then_hydrate(backing: Path, tmp_path: Path) -> None:
    from loaderplug import sync

    (tmp_path / "mnt").mkdir()
    (tmp_path / "mirror").mkdir()
    with mounted(tmp_path / "mirror", tmp_path / "mnt") as vol:
        sync(backing, vol.mountpoint / "m", **FAST)
        # No fallocate emulation on a network mount (glibc would write one byte per
        # 4 KiB block: 1024+ writes for these 4 MiB); writes come in 64 KiB ranges.
        assert vol.stats()["writes"] < 4 * MiB // 4096 // 4
        hydrate(vol.mountpoint / "m", tmp_path / "local", **FAST)
    assert tree_bytes(tmp_path / "local") == tree_bytes(backing)
    shutil.rmtree(tmp_path / "local")


@pytest.mark.parametrize("refusal", ["open", "read"])
def test_direct_io_refused_by_the_kernel_falls_back_to_buffered(
    backing: Path, tmp_path: Path, refusal: str
) -> None:
    (tmp_path / "mnt").mkdir()
    with mounted(backing, tmp_path / "mnt", VolumeProfile(refuse_direct_io=refusal)) as vol:
        # Forced on, so the reader tries O_DIRECT on this FUSE mount and is refused.
        report = hydrate(vol.mountpoint, tmp_path / "local", **{**FAST, "direct_io": "on"})
    assert report.ok and report.retries == 0
    assert tree_bytes(tmp_path / "local") == tree_bytes(backing)


def test_doctor_calls_the_test_volume_a_network_filesystem(volume: TestVolume) -> None:
    from loaderplug.cli.doctor import doctor

    line = doctor([str(volume.mountpoint)], environ={}).splitlines()[0]
    assert "fuse.loaderplug-testvol" in line and "buffered" in line
