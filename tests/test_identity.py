"""A source's identity means what it says on every filesystem: FUSE mounts report the
kernel's node ids as inode numbers, which change whenever the kernel forgets an inode
(memory pressure), so there a file counts as changed by its size or mtime only; a file
truly replaced (new content, new mtime) is still refused everywhere."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loaderplug import hydrate
from loaderplug.cli.doctor import doctor
from loaderplug.errors import TransferFailed
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.storage.source import PosixSource
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import VolumeProfile, mounted
from loaderplug.types import Identity, IOPolicy, same_mtime
from loaderplug.units import MiB
from tests.conftest import FAST, tree_bytes


def test_an_identity_ignores_the_inode_only_where_inodes_are_not_stable() -> None:
    one, renumbered = Identity(10, 5, 4), Identity(10, 5, 7)
    assert one.matches(renumbered, inode=False) and not one.matches(renumbered)
    assert not one.matches(Identity(10, 6, 4), inode=False)  # a new mtime: changed
    assert not one.matches(Identity(11, 5, 4), inode=False)  # a new size: changed
    kinds = [("fuse", False), ("fuse.geesefs", False), ("fuseblk", False)]
    kinds += [("ext4", True), ("nfs4", True), ("tmpfs", True)]
    for fs_type, stable in kinds:
        assert IOPolicy.buffered(fs_type, "test").stable_inodes is stable, fs_type


def test_a_stamp_reads_back_cut_to_what_the_filesystem_keeps() -> None:
    stamp = 1_700_000_000_123_456_789
    for kept in (stamp, 1_700_000_000_123_456_700, 1_700_000_000_123_456_000):
        assert same_mtime(stamp, kept), kept
    assert same_mtime(stamp, 1_700_000_000_000_000_000)  # whole seconds
    assert not same_mtime(stamp, 1_700_000_001_000_000_000)  # another second
    assert not same_mtime(stamp, 1_700_000_000_123_456_788)  # another time, not a cut
    assert not same_mtime(1_700_000_000_000_000_000, stamp)  # kept finer than stamped


class RenumberingSource:
    """The built-in source, reporting a new inode number each time it is asked, as a
    FUSE mount does for a file whose inode the kernel keeps forgetting."""

    numbers = itertools.count(1_000_000)

    def __init__(self, inner: PosixSource) -> None:
        self.inner = inner

    @property
    def size(self) -> int:
        return self.inner.size

    def identity(self) -> Identity:
        now = self.inner.identity()
        return Identity(now.size, now.mtime_ns, next(self.numbers))

    def pread_into(self, buf: memoryview, offset: int) -> int:
        return self.inner.pread_into(buf, offset)

    def close(self) -> None:
        self.inner.close()


class Renumbering:
    @hookimpl
    def loaderplug_open_source(self, path: str, policy: IOPolicy) -> RenumberingSource:
        return RenumberingSource(PosixSource(path, policy))


# The test volume answering every look with a new inode number.
RENUMBERING = VolumeProfile(per_stream_bytes_per_s=64 * MiB, inode_numbers="new-each-look")


@pytest.fixture
def fuse_model(tmp_path: Path) -> Iterator[Path]:
    backing = tmp_path / "backing"
    write_model(backing / "model", 3 * MiB, shards=3)
    with mounted(backing, tmp_path / "mnt", RENUMBERING):
        yield tmp_path / "mnt" / "model"


@pytest.mark.fuse
def test_inode_numbers_that_change_on_a_fuse_mirror_fail_nothing(
    fuse_model: Path, tmp_path: Path
) -> None:
    some = fuse_model / "config.json"
    assert os.stat(some).st_ino != os.stat(some).st_ino  # the volume renumbers
    report = hydrate(fuse_model, tmp_path / "local", **FAST)
    assert report.ok, [r.reason for r in report.failed]
    assert tree_bytes(tmp_path / "local") == tree_bytes(fuse_model)


def test_a_new_inode_on_local_disk_is_still_a_changed_file(
    model: Path, tmp_path: Path, register_plugin: Callable[[object], object]
) -> None:
    register_plugin(Renumbering())
    with pytest.raises(TransferFailed) as failed:
        hydrate(model, tmp_path / "local", **FAST)
    reasons = [r.reason for r in failed.value.report.failed]
    assert reasons and all("changed" in reason for reason in reasons), reasons


@pytest.mark.fuse
def test_a_file_replaced_on_a_fuse_mirror_mid_copy_is_never_published(
    tmp_path: Path, register_plugin: Callable[[object], object]
) -> None:
    backing = tmp_path / "backing"
    write_model(backing / "model", 8 * MiB, shards=2)
    victim = next(p for p in sorted((backing / "model").iterdir()) if p.stat().st_size > MiB)
    replaced = threading.Event()

    class ReplaceOnFirstRead:
        @hookimpl
        def loaderplug_open_source(self, path: str, policy: IOPolicy) -> object:
            inner = PosixSource(path, policy)
            if not path.endswith(victim.name):
                return inner
            source = inner
            read = source.pread_into

            def replace_then_read(buf: memoryview, offset: int) -> int:
                if not replaced.is_set():
                    replaced.set()
                    # New content, new mtime, put in place at once, as a sync does (a
                    # rewrite in place could be seen half-done: "shorter than expected").
                    fresh = victim.with_name(f".{victim.name}.new")
                    fresh.write_bytes(bytes(victim.stat().st_size))
                    os.utime(fresh, ns=(1, 1))
                    os.replace(fresh, victim)
                return read(buf, offset)

            source.pread_into = replace_then_read  # type: ignore[method-assign]
            return source

    register_plugin(ReplaceOnFirstRead())
    with (
        mounted(backing, tmp_path / "mnt", RENUMBERING),
        pytest.raises(TransferFailed) as failed,
    ):
        hydrate(tmp_path / "mnt" / "model", tmp_path / "local", **FAST)
    report = failed.value.report
    assert replaced.is_set()
    assert [r.path for r in report.failed] == [victim.name]
    assert "changed" in report.failed[0].reason
    assert not (tmp_path / "local" / victim.name).exists()


@pytest.mark.fuse
def test_doctor_says_whether_inode_numbers_are_stable(fuse_model: Path, tmp_path: Path) -> None:
    said = doctor([str(fuse_model), str(tmp_path)], environ={})
    on_fuse, local = said.splitlines()[:2]
    assert "inode numbers not stable" in on_fuse, on_fuse
    assert "inode numbers stable" in local, local


@pytest.mark.fuse
def test_the_one_pass_from_a_fuse_mirror_whose_inodes_change_completes(
    fuse_model: Path, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from loaderplug.tensors.reader import iter_tensors

    files = sorted(fuse_model.glob("*.safetensors"))
    assert files
    names = [name for name, _ in iter_tensors(files, local_dir=tmp_path / "local", **FAST)]
    assert names
    for f in files:
        assert (tmp_path / "local" / f.name).read_bytes() == f.read_bytes()
