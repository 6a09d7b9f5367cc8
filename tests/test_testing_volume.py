"""Tests for the FUSE test volume (loaderplug.testing.volume)."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loaderplug.testing.volume import (
    FSTYPE,
    Fault,
    Replace,
    TestVolume,
    VolumeProfile,
    fuse_unavailable_reason,
    mounted,
)
from loaderplug.units import MiB


def _mount_types(mountpoint: Path) -> list[str]:
    target = os.path.realpath(mountpoint)
    with open("/proc/mounts", encoding="utf-8") as f:
        rows = [line.split() for line in f]
    return [r[2] for r in rows if len(r) > 2 and r[1] == target]


def _write_random(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    backing = tmp_path / "backing"
    mnt = tmp_path / "mnt"
    backing.mkdir()
    mnt.mkdir()
    yield backing, mnt
    # A leaked mount would break tmp_path cleanup and every later test.
    assert _mount_types(mnt) == []


# -- no FUSE needed ---------------------------------------------------------


def test_profile_json_roundtrip() -> None:
    p = VolumeProfile(
        per_stream_bytes_per_s=1.5 * MiB,
        latency_s=0.01,
        faults=(
            Fault(errno.EIO, rate=0.5, path_glob="a*", limit=2),
            Fault(errno.ENOMEM, max_inflight=4, after_bytes=10),
            Fault(errno.ESTALE, path_glob="*.mark", ops=("utimens", "getattr")),
        ),
        replace=(Replace("x.bin", 5, "/tmp/y.bin"),),
        seed=7,
        inode_numbers="node-ids",
        stale_handles=0.25,
        whole_second_mtimes=True,
        attr_lag_s=1.5,
    )
    assert VolumeProfile.from_json(p.to_json()) == p
    for preset in (
        VolumeProfile.network_volume(),
        VolumeProfile.object_store(),
        VolumeProfile.object_store(4),
        VolumeProfile.unthrottled(),
    ):
        assert VolumeProfile.from_json(preset.to_json()) == preset
    assert VolumeProfile.object_store(4).faults[0].max_inflight == 4
    with pytest.raises(ValueError):
        Fault(errno.EIO, rate=1.5)
    with pytest.raises(ValueError, match=r"Fault\.ops"):
        Fault(errno.EIO, ops=("touch",))
    with pytest.raises(ValueError, match=r"Fault\.ops"):
        Fault(errno.EIO, ops=())
    with pytest.raises(ValueError):
        Replace("x", 0, "relative/path")
    with pytest.raises(ValueError, match="inode_numbers"):
        VolumeProfile(inode_numbers="sometimes")
    with pytest.raises(ValueError, match="stale_handles"):
        VolumeProfile(stale_handles=2.0)


def test_a_fault_fires_only_on_the_operations_it_names() -> None:
    from loaderplug.testing.faults import FaultPicker

    touch = Fault(errno.ESTALE, path_glob="*.mark", ops=("utimens",), limit=2)
    picker = FaultPicker([touch, Fault(errno.EIO, path_glob="*.bin")])
    assert picker.ops == {"utimens", "read"}
    assert picker.pick("m/.mark", 0, 0, "read") is None  # the touch fault spares reads
    assert picker.pick("m/.mark", 0, 0, "getattr") is None
    assert picker.pick("m/x.bin", 0, 1, "utimens") is None  # a read fault spares touches
    assert picker.pick("m/x.bin", 0, 1) is not None  # reads by default
    assert [picker.pick("m/.mark", 0, 0, "utimens") for _ in range(3)] == [touch, touch, None]


def test_why_fuse_is_unavailable_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    from loaderplug.testing import volume

    probe = fuse_unavailable_reason.__wrapped__
    monkeypatch.setattr(volume.os.path, "exists", lambda path: path != "/dev/fuse")
    assert "/dev/fuse does not exist" in str(probe())
    monkeypatch.undo()
    monkeypatch.setattr(volume.os, "access", lambda path, mode: True)
    monkeypatch.setattr(volume.os.path, "exists", lambda path: True)
    monkeypatch.setattr(volume.shutil, "which", lambda name: None)
    assert "fusermount3 is not on PATH" in str(probe())


# -- FUSE -------------------------------------------------------------------


@pytest.mark.fuse
def test_passthrough_reads_writes_and_fstype(dirs: tuple[Path, Path]) -> None:
    backing, mnt = dirs
    data = _write_random(backing / "sub" / "model-0001.safetensors", 3 * MiB + 12345)
    with mounted(backing, mnt) as vol:
        assert _mount_types(mnt)[-1].startswith("fuse.")
        assert _mount_types(mnt)[-1] == FSTYPE
        assert os.listdir(mnt / "sub") == ["model-0001.safetensors"]
        assert (mnt / "sub" / "model-0001.safetensors").read_bytes() == data
        st_b = os.stat(backing / "sub" / "model-0001.safetensors")
        st_m = os.stat(mnt / "sub" / "model-0001.safetensors")
        assert (st_m.st_ino, st_m.st_size, st_m.st_mtime_ns) == (
            st_b.st_ino,
            st_b.st_size,
            st_b.st_mtime_ns,
        )
        # Writes pass through to the backing folder.
        (mnt / "out").mkdir()
        (mnt / "out" / "w.bin").write_bytes(b"hello")
        os.rename(mnt / "out" / "w.bin", mnt / "out" / "v.bin")
        assert (backing / "out" / "v.bin").read_bytes() == b"hello"
        s = vol.stats()
        assert s["bytes_read"] >= len(data)
        assert s["opens"] >= 2
        assert s["faults_injected"] == 0
    assert _mount_types(mnt) == []


@pytest.mark.fuse
def test_unmounts_on_error_and_with_open_files(dirs: tuple[Path, Path]) -> None:
    backing, mnt = dirs
    _write_random(backing / "f.bin", 4096)
    held = None
    with pytest.raises(RuntimeError, match="boom"), mounted(backing, mnt):
        held = open(mnt / "f.bin", "rb")  # noqa: SIM115 - kept open on purpose
        raise RuntimeError("boom")
    assert _mount_types(mnt) == []
    assert held is not None
    # The server is gone: the stale handle errors instead of hanging.
    with pytest.raises(OSError):
        held.read()
    with contextlib.suppress(OSError):
        held.close()


def _timed_reads(path: Path, ranges: list[tuple[int, int]], chunk: int = MiB) -> tuple[float, int]:
    """Read each (offset, length) range on its own fd and thread."""
    total = [0]
    lock = threading.Lock()
    start = threading.Barrier(len(ranges) + 1)

    def worker(off: int, length: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            start.wait()
            got = 0
            while got < length:
                b = os.pread(fd, min(chunk, length - got), off + got)
                if not b:
                    break
                got += len(b)
            with lock:
                total[0] += got
        finally:
            os.close(fd)

    threads = [threading.Thread(target=worker, args=r) for r in ranges]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    return time.monotonic() - t0, total[0]


@pytest.mark.fuse
def test_per_stream_cap_and_parallel_scaling(dirs: tuple[Path, Path]) -> None:
    backing, mnt = dirs
    size = 8 * MiB
    _write_random(backing / "big.bin", size)
    profile = VolumeProfile(per_stream_bytes_per_s=40 * MiB)
    with mounted(backing, mnt, profile) as vol:
        one_s, one_n = _timed_reads(mnt / "big.bin", [(0, size)])
        n = 8
        part = size // n
        par_s, par_n = _timed_reads(mnt / "big.bin", [(i * part, part) for i in range(n)])
        stats = vol.stats()
    assert one_n == size and par_n == size
    one_tput = one_n / one_s / MiB
    par_tput = par_n / par_s / MiB
    print(
        f"\n1 stream: {one_tput:.1f} MiB/s ({one_s:.3f}s); "
        f"{n} streams: {par_tput:.1f} MiB/s ({par_s:.3f}s); "
        f"max in-flight reads {stats['max_inflight_reads']}"
    )
    # 8 MiB at 40 MiB/s is 0.2 s; allow slack, never bound from above.
    assert one_s >= 0.15
    assert par_tput > 1.5 * one_tput
    assert stats["max_inflight_reads"] > 1


@pytest.mark.fuse
@pytest.mark.parametrize("err", [errno.EIO, errno.ENOMEM, errno.EAGAIN, errno.EACCES])
def test_fault_limit_injects_exactly_n(dirs: tuple[Path, Path], err: int) -> None:
    backing, mnt = dirs
    data = _write_random(backing / "model-0002.safetensors", 64 * 1024)
    _write_random(backing / "other.bin", 4096)
    profile = VolumeProfile(faults=(Fault(err, path_glob="model-0002*.safetensors", limit=3),))
    with mounted(backing, mnt, profile) as vol:
        # A non-matching file is never faulted.
        assert len((mnt / "other.bin").read_bytes()) == 4096
        fd = os.open(mnt / "model-0002.safetensors", os.O_RDONLY)
        failures: list[int | None] = []
        try:
            for i in range(10):
                try:
                    got = os.pread(fd, 4096, i * 4096)
                    assert got == data[i * 4096 : (i + 1) * 4096]
                except OSError as e:
                    failures.append(e.errno)
        finally:
            os.close(fd)
        stats = vol.stats()
    assert failures == [err] * 3
    assert stats["faults_injected"] == 3


# Each operation a fault can fail besides reads, and the file its fault names.
FAULTED = {op: f"{op}.mark" for op in ("utimens", "getattr", "open", "create", "write", "fsync")}
FAULTED |= {"rename": "rename.mark", "unlink": "unlink.mark"}


@pytest.mark.fuse
@pytest.mark.parametrize("err", [errno.ESTALE, errno.EIO])
def test_faults_on_metadata_writes_and_opens_fail_those_requests_alone(
    dirs: tuple[Path, Path], err: int
) -> None:
    backing, mnt = dirs
    there = {op: name for op, name in FAULTED.items() if op != "create"}  # made in the test
    data = {name: _write_random(backing / name, 4096) for name in there.values()}
    faults = tuple(Fault(err, path_glob=name, ops=(op,)) for op, name in FAULTED.items())
    at = {op: mnt / name for op, name in FAULTED.items()}
    with mounted(backing, mnt, VolumeProfile(faults=faults)) as vol:
        with pytest.raises(OSError) as touched:
            os.utime(at["utimens"])
        assert os.stat(at["utimens"]).st_size == 4096  # its other requests are served
        assert (at["utimens"]).read_bytes() == data["utimens.mark"]
        with pytest.raises(OSError) as statted:
            os.stat(at["getattr"])
        with pytest.raises(OSError) as opened:
            os.open(at["open"], os.O_RDONLY)
        os.utime(at["open"])
        with pytest.raises(OSError) as created:
            os.open(at["create"], os.O_CREAT | os.O_WRONLY)
        fd = os.open(at["write"], os.O_RDWR)
        try:
            assert os.pread(fd, 4096, 0) == data["write.mark"]
            with pytest.raises(OSError) as written:
                os.pwrite(fd, b"x", 0)
        finally:
            os.close(fd)
        fd = os.open(at["fsync"], os.O_RDWR)
        try:
            assert os.pwrite(fd, b"x", 0) == 1
            with pytest.raises(OSError) as synced:
                os.fsync(fd)
        finally:
            os.close(fd)
        with pytest.raises(OSError) as renamed:
            os.rename(at["rename"], mnt / "moved.bin")
        with pytest.raises(OSError) as unlinked:
            os.unlink(at["unlink"])
        # A path no fault names: every request served.
        (mnt / "other.bin").write_bytes(b"y")
        os.utime(mnt / "other.bin")
        os.rename(mnt / "other.bin", mnt / "other2.bin")
        os.unlink(mnt / "other2.bin")
        stats = vol.stats()
    raised = (touched, statted, opened, created, written, synced, renamed, unlinked)
    assert [r.value.errno for r in raised] == [err] * len(FAULTED)
    assert sorted(p.name for p in backing.iterdir()) == sorted(there.values())
    assert stats["faults_injected"] >= len(FAULTED)


@pytest.mark.fuse
def test_fault_after_bytes_gives_short_read(dirs: tuple[Path, Path]) -> None:
    backing, mnt = dirs
    data = _write_random(backing / "f.bin", 2 * MiB)
    profile = VolumeProfile(faults=(Fault(errno.EIO, after_bytes=MiB),))
    with mounted(backing, mnt, profile):
        fd = os.open(mnt / "f.bin", os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == data[:4096]
            with pytest.raises(OSError) as exc:
                os.pread(fd, 4096, MiB)
            assert exc.value.errno == errno.EIO
            # The kernel splits a large pread into requests; a failure after
            # the first one surfaces as a short read, not an exception.
            got = os.pread(fd, 2 * MiB, 0)
            assert MiB <= len(got) < 2 * MiB
            assert got == data[: len(got)]
        finally:
            os.close(fd)


@pytest.mark.fuse
def test_max_inflight_fault_only_under_concurrency(dirs: tuple[Path, Path]) -> None:
    backing, mnt = dirs
    _write_random(backing / "f.bin", MiB)
    profile = VolumeProfile(latency_s=0.05, faults=(Fault(errno.ENOMEM, max_inflight=2),))
    with mounted(backing, mnt, profile) as vol:
        fd = os.open(mnt / "f.bin", os.O_RDONLY)
        try:
            for i in range(5):
                assert len(os.pread(fd, 4096, i * 4096)) == 4096
        finally:
            os.close(fd)
        assert vol.stats()["faults_injected"] == 0

        errors: list[int | None] = []
        lock = threading.Lock()
        barrier = threading.Barrier(8)

        def worker(i: int) -> None:
            wfd = os.open(mnt / "f.bin", os.O_RDONLY)
            try:
                barrier.wait()
                os.pread(wfd, 4096, i * 4096)
            except OSError as e:
                with lock:
                    errors.append(e.errno)
            finally:
                os.close(wfd)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = vol.stats()
    print(f"\nENOMEM under 8 concurrent reads: {len(errors)}; stats {stats}")
    assert errors and set(errors) == {errno.ENOMEM}
    assert stats["faults_injected"] == len(errors)
    assert stats["max_inflight_reads"] > 2


@pytest.mark.fuse
def test_replace_mid_read(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    backing, mnt = dirs
    old = _write_random(backing / "m.bin", MiB)
    new = _write_random(tmp_path / "staged" / "m-new.bin", 2 * MiB)
    profile = VolumeProfile(
        replace=(Replace("m.bin", 256 * 1024, str(tmp_path / "staged" / "m-new.bin")),)
    )
    with mounted(backing, mnt, profile) as vol:
        fd = os.open(mnt / "m.bin", os.O_RDONLY)
        try:
            before = os.fstat(fd)
            assert os.pread(fd, 256 * 1024, 0) == old[: 256 * 1024]
            # The threshold was reached: the same handle now reads the new file.
            assert os.pread(fd, 4096, 256 * 1024) == new[256 * 1024 : 260 * 1024]
            assert os.pread(fd, 4096, MiB + 4096) == new[MiB + 4096 : MiB + 8192]
            after = os.fstat(fd)
        finally:
            os.close(fd)
        by_path = os.stat(mnt / "m.bin")
        assert isinstance(vol, TestVolume)
        assert vol.stats()["replacements"] == 1
    assert before.st_size == MiB
    assert after.st_size == by_path.st_size == 2 * MiB
    assert after.st_ino != before.st_ino
    assert by_path.st_ino == after.st_ino
    assert (backing / "m.bin").read_bytes() == new


# -- the habits of real network filesystems -----------------------------------


@pytest.mark.fuse
def test_node_ids_change_when_the_kernel_forgets_an_inode(dirs: tuple[Path, Path]) -> None:
    from loaderplug.testing.eviction import evicting, eviction_unavailable_reason

    if eviction_unavailable_reason() is not None:
        pytest.skip(str(eviction_unavailable_reason()))
    backing, mnt = dirs
    _write_random(backing / "f.bin", 4096)
    with mounted(backing, mnt, VolumeProfile(inode_numbers="node-ids")):
        seen = [os.stat(mnt / "f.bin").st_ino]
        # The kernel tells the filesystem it forgot a node asynchronously, and a busy
        # host may keep the dentry through one drop: drop until the number changes.
        for _ in range(2):
            for _attempt in range(50):
                with evicting(period_s=60):  # one drop, at once
                    pass
                ino = os.stat(mnt / "f.bin").st_ino
                if ino != seen[-1]:
                    break
                time.sleep(0.02)
            seen.append(ino)
        assert len(set(seen)) == 3, seen
        assert os.stat(mnt / "f.bin").st_ino != (backing / "f.bin").stat().st_ino
    with mounted(backing, mnt, VolumeProfile(inode_numbers="new-each-look")):
        assert os.stat(mnt / "f.bin").st_ino != os.stat(mnt / "f.bin").st_ino


@pytest.mark.fuse
def test_whole_second_mtimes(dirs: tuple[Path, Path]) -> None:
    backing, mnt = dirs
    _write_random(backing / "f.bin", 100)
    os.utime(backing / "f.bin", ns=(1_700_000_000_123_456_789,) * 2)
    with mounted(backing, mnt, VolumeProfile(whole_second_mtimes=True)):
        assert os.stat(mnt / "f.bin").st_mtime_ns == 1_700_000_000_000_000_000


@pytest.mark.fuse
def test_a_stale_handle_stays_stale_and_a_new_open_reads(dirs: tuple[Path, Path]) -> None:
    backing, mnt = dirs
    data = _write_random(backing / "f.bin", 64 * 1024)
    with mounted(backing, mnt, VolumeProfile(stale_handles=1.0)) as vol:
        for _ in range(2):
            fd = os.open(mnt / "f.bin", os.O_RDONLY)
            try:
                for _ in range(3):  # the first read finds it stale, and so does every later
                    with pytest.raises(OSError) as stale:
                        os.pread(fd, 4096, 0)
                    assert stale.value.errno == errno.ESTALE
            finally:
                os.close(fd)
        assert vol.stats()["stale_handles"] == 2  # one per handle
    with mounted(backing, mnt, VolumeProfile(stale_handles=0.5, seed=3)) as vol:
        got, opens = b"", 0
        while len(got) < len(data):
            fd = os.open(mnt / "f.bin", os.O_RDONLY)
            opens += 1
            try:
                while len(got) < len(data):
                    got += os.pread(fd, 4096, len(got))
            except OSError as exc:
                assert exc.errno == errno.ESTALE
            finally:
                os.close(fd)
        assert got == data and opens > 1


@pytest.mark.fuse
def test_a_handle_to_a_replaced_file_is_stale_where_handles_go_stale(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    backing, mnt = dirs
    _write_random(backing / "m.bin", MiB)
    new = _write_random(tmp_path / "staged" / "m-new.bin", MiB)
    swap = Replace("m.bin", 64 * 1024, str(tmp_path / "staged" / "m-new.bin"))
    profile = VolumeProfile(stale_handles=1e-9, replace=(swap,))
    with mounted(backing, mnt, profile):
        fd = os.open(mnt / "m.bin", os.O_RDONLY)
        try:
            os.pread(fd, 64 * 1024, 0)
            with pytest.raises(OSError) as stale:
                os.pread(fd, 4096, 64 * 1024)
            assert stale.value.errno == errno.ESTALE
        finally:
            os.close(fd)
        assert (mnt / "m.bin").read_bytes() == new


@pytest.mark.fuse
def test_attributes_lag_a_replacement_until_an_open(dirs: tuple[Path, Path]) -> None:
    backing, mnt = dirs
    _write_random(backing / "f.bin", 1000)
    with mounted(backing, mnt, VolumeProfile(attr_lag_s=30.0)):
        assert os.stat(mnt / "f.bin").st_size == 1000
        _write_random(backing / "f.new", 10)
        os.replace(backing / "f.new", backing / "f.bin")  # behind the mount's back
        assert os.stat(mnt / "f.bin").st_size == 1000  # the cached answer
        with open(mnt / "f.bin", "rb") as f:  # close-to-open: an open sees it as it is
            assert os.fstat(f.fileno()).st_size == 10
        assert os.stat(mnt / "f.bin").st_size == 10
        # The mount's own changes show at once.
        (mnt / "g.bin").write_bytes(b"abc")
        assert os.stat(mnt / "g.bin").st_size == 3
        with open(mnt / "g.bin", "ab") as f:
            f.write(b"de")
        assert os.stat(mnt / "g.bin").st_size == 5
