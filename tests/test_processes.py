"""Real processes: Ctrl-C, kill -9 and four ranks hydrating one destination at once."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from loaderplug import hydrate
from loaderplug.testing import slowed
from tests.conftest import FAST, leftover_temps, tree_bytes

pytestmark = pytest.mark.crash

REPO = Path(__file__).resolve().parent.parent


def start(
    src: Path, dst: Path, delay_s: float, *extra: str, read_log: Path | None = None
) -> subprocess.Popen[str]:
    args = ["hydrate", "--from", str(src), "--to", str(dst), "--chunk-bytes", "64K", *extra]
    env = {"LOADERPLUG_SPLIT_THRESHOLD_BYTES": "128K", "SLOW_HYDRATE_READ_LOG": str(read_log or "")}
    return slowed.start(args, delay_s, env)


def wait_for_temps(
    dst: Path, proc: subprocess.Popen[str], timeout_s: float = 20, read_log: Path | None = None
) -> None:
    """Wait until the copy is under way: temp files exist (and, with ``read_log``, a
    read has started; temp files are created before the first read)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dst.exists() and leftover_temps(dst) and (read_log is None or read_log.exists()):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the hydrate never started copying")


def published_files_are_complete(src: Path, dst: Path) -> None:
    source = tree_bytes(src)
    for rel, data in tree_bytes(dst).items():
        assert data == source[rel], f"{rel} was published incomplete"


@pytest.mark.slow("interrupts a hydrate running in a process of its own")
def test_sigint_stops_after_the_reads_in_flight_and_cleans_up(model: Path, tmp_path: Path) -> None:
    dst, reads = tmp_path / "local", tmp_path / "reads.log"
    proc = start(model, dst, 0.2, read_log=reads)
    wait_for_temps(dst, proc, read_log=reads)
    proc.send_signal(signal.SIGINT)
    started_before = len(reads.read_text().splitlines())
    _out, err = proc.communicate(timeout=30)
    started_after = len(reads.read_text().splitlines()) - started_before
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    # Stopping takes about one range: the reads in flight finish and no new ones start.
    # A busy machine may deliver the signal a moment late, so allow one more read per
    # worker (8 by default); running on to the end would start about 30 more.
    assert started_after <= 16, f"{started_after} reads started after SIGINT"
    assert leftover_temps(dst) == []
    published_files_are_complete(model, dst)
    assert len(tree_bytes(dst)) < len(tree_bytes(model))  # it really was stopped mid-way


def test_sigterm_cleans_up_like_ctrl_c(model: Path, tmp_path: Path) -> None:
    dst = tmp_path / "local"
    proc = start(model, dst, 0.2)
    wait_for_temps(dst, proc)
    proc.terminate()
    proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert leftover_temps(dst) == []


def test_kill_9_then_a_second_hydrate_completes_without_temp_files(
    model: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "local"
    proc = start(model, dst, 0.2)
    wait_for_temps(dst, proc)
    proc.kill()
    proc.communicate(timeout=30)
    assert leftover_temps(dst), "kill -9 cannot clean up; the next run must"
    published_files_are_complete(model, dst)
    report = hydrate(model, dst, **FAST)
    assert report.ok
    assert tree_bytes(dst) == tree_bytes(model)
    assert leftover_temps(dst) == []


def test_four_processes_hydrating_one_destination_copy_each_file_once(
    model: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "local"
    procs = [start(model, dst, 0.01, "--json") for _ in range(4)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        reports.append(json.loads(out))
    restored = [r["path"] for rep in reports for r in rep["results"] if r["status"] == "restored"]
    assert sorted(restored) == sorted(tree_bytes(model))  # every file exactly once
    assert sum(1 for rep in reports if rep["restored"]) == 1
    assert all(rep["skipped"] == len(tree_bytes(model)) for rep in reports if not rep["restored"])
    assert tree_bytes(dst) == tree_bytes(model)
    assert leftover_temps(dst) == []
