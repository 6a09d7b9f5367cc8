"""A mirror a sync is writing, or died writing, is never hydrated as a model."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loaderplug import MirrorError, hydrate, sync
from loaderplug.engine.retry import RetryPolicy
from loaderplug.jobs.sync_mark import MARK_NAME, SyncMark, read_mark, wait_for_sync
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.storage.source import PosixSource
from loaderplug.testing import slowed
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import Fault, TestVolume, VolumeProfile, mounted
from loaderplug.types import IOPolicy
from loaderplug.units import MiB
from tests.conftest import FAST, leftover_temps, tree_bytes

REPO = Path(__file__).resolve().parent.parent
QUICK_MARKS = {"sync_stale_s": 2, "sync_wait_s": 30}


def start_sync(local: Path, mirror: Path, delay_s: float) -> subprocess.Popen[str]:
    args = ["sync", "--from", str(local), "--to", str(mirror), "--chunk-bytes", "64K"]
    env = {"LOADERPLUG_SPLIT_THRESHOLD_BYTES": "128K", "LOADERPLUG_SYNC_STALE_S": "2"}
    return slowed.start(args, delay_s, env)


def wait_until(condition: object, timeout_s: float = 30, waiting_for: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {waiting_for}" if waiting_for else "timed out")


@pytest.mark.slow("kills a sync in a process of its own")
def test_a_hydrate_of_a_mirror_whose_first_sync_was_killed_fails_and_publishes_nothing(
    model: Path, tmp_path: Path
) -> None:
    mirror = tmp_path / "synced"
    proc = start_sync(model, mirror, 0.2)
    wait_until(lambda: mirror.exists() and leftover_temps(mirror))
    proc.kill()
    proc.communicate(timeout=30)
    with pytest.raises(MirrorError, match="died while writing this mirror"):
        hydrate(mirror, tmp_path / "local", **FAST, **QUICK_MARKS)
    assert not (tmp_path / "local").exists() or tree_bytes(tmp_path / "local") == {}
    # Synced again, the mirror is whole and hydrates.
    sync(model, mirror, **FAST, **QUICK_MARKS)
    hydrate(mirror, tmp_path / "local", **FAST, **QUICK_MARKS)
    assert tree_bytes(tmp_path / "local") == tree_bytes(model)


@pytest.mark.slow("kills a sync in a process of its own")
def test_a_resync_killed_over_an_older_one_is_refused_not_mixed(
    model: Path, tmp_path: Path
) -> None:
    mirror, local = tmp_path / "synced", tmp_path / "local"
    sync(model, mirror, **FAST)
    hydrate(mirror, local, **FAST)
    old = tree_bytes(local)
    newer = tmp_path / "newer"
    write_model(newer, 2 * MiB, shards=4, seed=7)  # the same names, other bytes
    proc = start_sync(newer, mirror, 0.2)
    wait_until(lambda: leftover_temps(mirror) and (mirror / MARK_NAME).exists())
    time.sleep(0.5)  # a file or two replaced, the old manifest still there
    proc.kill()
    proc.communicate(timeout=30)
    with pytest.raises(MirrorError, match="died while writing this mirror"):
        hydrate(mirror, local, **FAST, **QUICK_MARKS)
    assert tree_bytes(local) == old  # nothing of the new generation published


def test_a_hydrate_waits_for_a_live_sync_and_gets_its_whole_model(
    model: Path, tmp_path: Path
) -> None:
    mirror = tmp_path / "synced"
    proc = start_sync(model, mirror, 0.05)
    wait_until(lambda: (mirror / MARK_NAME).exists())
    report = hydrate(mirror, tmp_path / "local", **FAST, **QUICK_MARKS)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert report.ok and tree_bytes(tmp_path / "local") == tree_bytes(model)
    assert not (mirror / MARK_NAME).exists()


def test_two_syncs_at_once_take_turns_and_the_manifest_matches_the_files(
    model: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    write_model(other, 2 * MiB, shards=4, seed=3)
    mirror = tmp_path / "synced"
    procs = [start_sync(model, mirror, 0.02), start_sync(other, mirror, 0.02)]
    for proc in procs:
        proc.communicate(timeout=120)
        assert proc.returncode == 0
    manifest = json.loads((mirror / ".loaderplug-manifest.json").read_text())
    for rel, entry in manifest["files"].items():
        st = (mirror / rel).stat()
        assert (st.st_size, st.st_mtime_ns) == (entry["size"], entry["mtime_ns"]), rel
    # The mirror is one of the two generations, whole.
    assert tree_bytes(mirror) in (tree_bytes(model), tree_bytes(other))


def test_a_sync_that_fails_leaves_a_mark_hydrates_refuse_at_once(tmp_path: Path) -> None:
    mirror = tmp_path / "synced"
    with pytest.raises(OSError), SyncMark(mirror, wait_s=1, stale_s=60):
        raise OSError(errno.EIO, "the volume went away")
    mark = read_mark(mirror / MARK_NAME)
    assert mark is not None and mark.abandoned
    with pytest.raises(MirrorError, match="failed while writing this mirror"):
        wait_for_sync(mirror, wait_s=30, stale_s=60)


def test_a_dead_syncers_mark_is_taken_over_and_a_live_one_waited_for(tmp_path: Path) -> None:
    mirror = tmp_path / "synced"
    mirror.mkdir()
    (mirror / MARK_NAME).write_text('{"host": "gone", "pid": 1, "started": "then"}')
    stale = time.time() - 120
    os.utime(mirror / MARK_NAME, (stale, stale))
    with SyncMark(mirror, wait_s=5, stale_s=60) as first:
        assert "gone" not in (mirror / MARK_NAME).read_text()
        taken = threading.Event()

        def second() -> None:
            with SyncMark(mirror, wait_s=30, stale_s=60):
                taken.set()

        waiter = threading.Thread(target=second)
        waiter.start()
        assert not taken.wait(0.5)  # the first is alive: the second waits
        assert first.token in (mirror / MARK_NAME).read_text()
    assert taken.wait(10)
    waiter.join()
    assert not (mirror / MARK_NAME).exists()


@pytest.mark.parametrize("ends", ["cleanly", "with an error"])
def test_a_syncer_whose_mark_was_taken_over_leaves_the_new_owners_mark_alone(
    tmp_path: Path, ends: str
) -> None:
    """A syncer thought dead (its mark went stale) whose mark a second syncer took over:
    when the first ends, it neither removes the second's mark nor marks it abandoned, and
    its heart no longer refreshes it."""
    mirror = tmp_path / "synced"
    first = SyncMark(mirror, wait_s=5, stale_s=2)
    first.__enter__()
    first._stop.set()  # its heart stalls, as in a syncer frozen for a while
    assert first._heart is not None
    first._heart.join()
    stale = time.time() - 60
    os.utime(mirror / MARK_NAME, (stale, stale))
    with SyncMark(mirror, wait_s=5, stale_s=2) as second:
        error = None if ends == "cleanly" else RuntimeError("the first sync failed late")
        first.__exit__(type(error) if error else None, error, None)
        mark = json.loads((mirror / MARK_NAME).read_text())
        assert mark["token"] == second.token and not mark.get("abandoned"), mark
    assert not (mirror / MARK_NAME).exists()  # the second, ending cleanly, removed its own


def test_an_abandoned_mark_is_written_whole(tmp_path: Path) -> None:
    """A sync that fails rewrites its mark as abandoned by a rename: no reader ever finds
    it empty or half-written, and no temp file is left."""
    mirror = tmp_path / "synced"
    with pytest.raises(RuntimeError), SyncMark(mirror, wait_s=5, stale_s=60):
        raise RuntimeError("failed")
    mark = read_mark(mirror / MARK_NAME)
    assert mark is not None and mark.abandoned
    assert sorted(p.name for p in mirror.iterdir()) == [MARK_NAME]


# The mark, by name (the volume's faults fire on requests of paths they match).
MARK_PATHS = f"*{MARK_NAME}"
TRANSIENT = [errno.ESTALE, errno.EIO, errno.ENOMEM]


@contextlib.contextmanager
def faulty_mirror(
    tmp_path: Path, error: int, times: int | None, ops: tuple[str, ...] = ("read",)
) -> Iterator[TestVolume]:
    """A volume whose first ``times`` requests (None: all) of the operations ``ops`` on a
    sync mark fail with ``error``: its reads by default."""
    (tmp_path / "backing").mkdir()
    profile = VolumeProfile(faults=(Fault(error, path_glob=MARK_PATHS, limit=times, ops=ops),))
    with mounted(tmp_path / "backing", tmp_path / "mnt", profile) as vol:
        yield vol


@pytest.mark.fuse
@pytest.mark.parametrize("error", TRANSIENT, ids=errno.errorcode.get)
def test_a_sync_removes_its_own_mark_after_a_transient_error_reading_it(
    model: Path, tmp_path: Path, error: int
) -> None:
    with faulty_mirror(tmp_path, error, times=1) as vol:
        mirror = vol.mountpoint / "synced"
        sync(model, mirror, **FAST)
        assert vol.stats()["faults_injected"] == 1
        assert not (mirror / MARK_NAME).exists()
        # The next hydrate finds no sync under way: it neither waits nor refuses.
        hydrate(mirror, tmp_path / "local", **FAST, sync_wait_s=0)
    assert tree_bytes(tmp_path / "local") == tree_bytes(model)


@pytest.mark.fuse
def test_a_finished_sync_whose_mark_stays_unreadable_says_it_left_it(tmp_path: Path) -> None:
    """A mark that cannot be read may be another syncer's: it is left in place, and the
    user is told what to do about it."""
    with faulty_mirror(tmp_path, errno.EIO, times=None) as vol:
        mirror = vol.mountpoint / "synced"
        retry = RetryPolicy(attempts=3, base_ms=1, max_ms=2)
        with (
            pytest.raises(MirrorError, match="the sync finished, but its mark") as raised,
            SyncMark(mirror, wait_s=5, stale_s=60, retry=retry),
        ):
            pass
        assert "after 3 attempts" in str(raised.value)
        assert "delete the mark" in str(raised.value)
        assert (mirror / MARK_NAME).exists()


@pytest.mark.fuse
@pytest.mark.slow("waits for a mark to be refreshed past its staleness limit")
def test_a_syncs_mark_is_refreshed_through_transient_errors(tmp_path: Path) -> None:
    with faulty_mirror(tmp_path, errno.EIO, times=3) as vol:
        mirror = vol.mountpoint / "synced"
        with SyncMark(mirror, wait_s=5, stale_s=2):
            wait_until(lambda: vol.stats()["faults_injected"] == 3)
            after_errors = (mirror / MARK_NAME).stat().st_mtime_ns
            # Still refreshed a whole staleness limit after the errors: alive, not dead.
            past_stale = after_errors + 2 * 10**9
            wait_until(lambda: (mirror / MARK_NAME).stat().st_mtime_ns > past_stale)
            with pytest.raises(MirrorError, match="still writing this mirror"):
                wait_for_sync(mirror, wait_s=0, stale_s=2)
        assert not (mirror / MARK_NAME).exists()


@pytest.mark.fuse
@pytest.mark.parametrize("error", TRANSIENT, ids=errno.errorcode.get)
def test_a_live_mark_read_through_transient_errors_is_waited_for(
    tmp_path: Path, error: int
) -> None:
    with faulty_mirror(tmp_path, error, times=2) as vol:
        mirror = vol.mountpoint / "synced"
        (tmp_path / "backing" / "synced").mkdir()
        (tmp_path / "backing" / "synced" / MARK_NAME).write_text(
            '{"host": "worker-7", "pid": 42, "started": "now", "token": "t"}'
        )
        with pytest.raises(MirrorError, match=r"worker-7 pid 42.*still writing this mirror"):
            wait_for_sync(mirror, wait_s=0, stale_s=60)
        assert vol.stats()["faults_injected"] == 2


@pytest.mark.fuse
@pytest.mark.parametrize("error", TRANSIENT, ids=errno.errorcode.get)
def test_a_failed_syncs_mark_read_through_transient_errors_is_refused(
    model: Path, tmp_path: Path, error: int
) -> None:
    with faulty_mirror(tmp_path, error, times=2) as vol:
        mirror = vol.mountpoint / "synced"
        shutil.copytree(model, tmp_path / "backing" / "synced")
        (tmp_path / "backing" / "synced" / MARK_NAME).write_text(
            '{"host": "worker-7", "pid": 42, "started": "then", "abandoned": true}'
        )
        with pytest.raises(MirrorError, match=r"worker-7 pid 42.*failed while writing"):
            hydrate(mirror, tmp_path / "local", **FAST)
        assert vol.stats()["faults_injected"] == 2


class Gated:
    """A plugin whose sources read nothing until ``gate`` is set: a sync held open, its
    mark taken and refreshed, for as long as a test needs."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    @hookimpl
    def loaderplug_open_source(self, path: str, policy: IOPolicy) -> PosixSource:
        gate = self.gate

        class GatedSource(PosixSource):
            def pread_into(self, buf: memoryview, offset: int) -> int:
                gate.wait()
                return super().pread_into(buf, offset)

        return GatedSource(path, policy)


# Failed touches of the mark: with two attempts a touch, more than a whole refresh gives
# up (the kernel tries a path again once on ESTALE, so a touch may take two of them).
TOUCH_FAULTS = 5
TWO_ATTEMPTS = {**FAST, "retry_attempts": 2, "sync_stale_s": 2}


@pytest.mark.fuse
@pytest.mark.slow("holds a sync open through several refreshes of its mark")
@pytest.mark.parametrize("error", [errno.ESTALE, errno.EIO], ids=errno.errorcode.get)
def test_a_sync_keeps_its_mark_through_transient_errors_touching_it(
    model: Path, tmp_path: Path, error: int, register_plugin: Any
) -> None:
    """A touch of the mark that fails (a stale NFS handle, EIO) is no lost mark: the sync
    refreshes it on, a hydrate meanwhile finds a live sync, and the sync ends whole."""
    held = register_plugin(Gated())
    with faulty_mirror(tmp_path, error, TOUCH_FAULTS, ops=("utimens",)) as vol:
        mirror = vol.mountpoint / "synced"
        reports: list[Any] = []
        syncing = threading.Thread(
            target=lambda: reports.append(sync(model, mirror, **TWO_ATTEMPTS))
        )
        syncing.start()
        try:
            touches = "the mark touched until every fault fired"
            wait_until(lambda: vol.stats()["faults_injected"] == TOUCH_FAULTS, 30, touches)
            after_errors = (mirror / MARK_NAME).stat().st_mtime_ns
            # Touched again after every fault fired: its heart beats on.
            touched = "the mark touched after the faults"
            wait_until(lambda: (mirror / MARK_NAME).stat().st_mtime_ns > after_errors, 30, touched)
            with pytest.raises(MirrorError, match="still writing this mirror"):
                wait_for_sync(mirror, wait_s=0, stale_s=2)
        finally:
            held.gate.set()
            syncing.join(60)
        assert reports and reports[0].ok
        assert not (mirror / MARK_NAME).exists()
        hydrate(mirror, tmp_path / "local", **FAST, sync_wait_s=0)
    assert tree_bytes(tmp_path / "local") == tree_bytes(model)
