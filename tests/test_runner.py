"""The runner gives every job a hydrate's guarantees: the lock, the leftover sweep, the
current-file rule, observers and one report. Here for the one pass (a load with
``local_dir``), in real processes and on the FUSE test volume."""

from __future__ import annotations

import errno
import json
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from loaderplug import hookimpl, hydrate
from loaderplug.storage.source import PosixSource
from loaderplug.testing import slowed
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import VolumeProfile, mounted
from loaderplug.types import IOPolicy
from loaderplug.units import MiB
from tests.conftest import FAST, leftover_temps

pytest.importorskip("torch")
pytest.importorskip("safetensors")

REPO = Path(__file__).resolve().parent.parent


def start_one_pass(mirror: Path, local: Path, delay_s: float) -> subprocess.Popen[str]:
    """``loaderplug load --from MIRROR --to LOCAL --json``, every read slowed down."""
    args = ["load", "--from", str(mirror), "--to", str(local), "--json"]
    env = {
        "LOADERPLUG_SPAN_BYTES": "64K",
        "LOADERPLUG_SPLIT_THRESHOLD_BYTES": "128K",
        "LOADERPLUG_READERS": "4",
    }
    return slowed.start(args, delay_s, env)


def shards_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.slow("one passes in processes of their own")
def test_two_one_passes_into_one_local_dir_write_each_file_once(
    model: Path, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    procs = [start_one_pass(model, local, 0.01) for _ in range(2)]
    figures = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        figures.append(json.loads(out))
    assert all(f["tensors"] == 16 for f in figures)  # each process got every tensor
    restored = Counter(
        r["path"] for f in figures for r in f["report"]["results"] if r["status"] == "restored"
    )
    assert restored == Counter(list(shards_of(model)))  # each file written once, by one
    assert shards_of(local) == shards_of(model)
    assert leftover_temps(local) == []


def wait_for_temps(local: Path, proc: subprocess.Popen[str], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if local.exists() and leftover_temps(local):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("the one pass never started copying")


@pytest.mark.slow("kills a one pass again and again")
def test_a_one_pass_killed_again_and_again_leaves_no_temp_file_once_it_completes(
    model: Path, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    for _ in range(3):
        proc = start_one_pass(model, local, 0.2)
        wait_for_temps(local, proc)
        proc.kill()
        proc.communicate(timeout=30)
        # A killed process cannot clean up: at most its own run's temp files are left,
        # the earlier runs' were swept when it took the lock.
        assert 0 < len(leftover_temps(local)) <= len(shards_of(model))
        for name, data in shards_of(local).items():  # what was published is whole
            assert data == shards_of(model)[name]
    proc = start_one_pass(model, local, 0.0)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(out)["tensors"] == 16
    assert shards_of(local) == shards_of(model)
    assert leftover_temps(local) == []


@pytest.mark.fuse
def test_a_one_pass_over_a_current_local_copy_reads_nothing_from_the_mirror(
    tmp_path: Path,
) -> None:
    from loaderplug.tensors.reader import iter_tensors
    from tests.helpers.tensors import reference, same

    backing = tmp_path / "backing"
    write_model(backing, 8 * MiB, shards=2)
    local = tmp_path / "local"
    with mounted(backing, tmp_path / "mnt", VolumeProfile.unthrottled()) as vol:
        shards = sorted(vol.mountpoint.glob("*.safetensors"))
        first = dict(iter_tensors(shards, local_dir=local, **FAST))
        vol.reset_stats()
        load = iter_tensors(shards, local_dir=local, **FAST)
        second = dict(load)
        served = vol.stats()
    assert served["bytes_read"] == 0 and served["opens"] == 0
    want = reference(sorted(backing.glob("*.safetensors")))
    assert all(same(first[k], want[k]) and same(second[k], want[k]) for k in want)
    assert load.report is not None
    assert {r.status for r in load.report.results} == {"loaded"}


def test_header_read_retries_count_in_the_report(shards: list[Path], inject) -> None:
    from loaderplug.tensors.reader import iter_tensors

    # The first read of every file is its header's: two of them fail, then succeed.
    plugin = inject(errno.EAGAIN, match="", times=2)
    load = iter_tensors(shards, direct_io="off", **FAST)
    got = dict(load)
    assert got and plugin.injected == 2
    assert load.report is not None and load.report.retries == 2


def test_each_reader_opens_a_source_once_per_file_it_reads(
    model: Path, tmp_path: Path, register_plugin
) -> None:
    opened: Counter[tuple[str, str]] = Counter()
    lock = threading.Lock()

    class CountOpens:
        @hookimpl
        def loaderplug_open_source(self, path: str, policy: IOPolicy) -> PosixSource:
            with lock:
                opened[(threading.current_thread().name, Path(path).name)] += 1
            return PosixSource(path, policy)

    register_plugin(CountOpens())
    report = hydrate(model, tmp_path / "local", **FAST)
    assert report.ok
    readers = {k: n for k, n in opened.items() if "-read-" in k[0]}
    assert readers and max(readers.values()) == 1, readers
    # Plus one fresh open per file before it is published, to see that it held still.
    finals = Counter(name for (thread, name), n in opened.items() if "-read-" not in thread)
    assert finals == Counter({r.path: 1 for r in report.restored})
