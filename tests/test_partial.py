"""A killed hydrate or one pass resumes: the next run reads only what had not landed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from loaderplug.engine.spans import Landed
from loaderplug.jobs.partial import journal_for, read_landed
from loaderplug.testing import slowed
from loaderplug.testing.model import write_model
from loaderplug.types import Identity
from loaderplug.units import MiB
from tests.conftest import leftover_temps

REPO = Path(__file__).resolve().parent.parent
CHUNK = 256 * 1024
WORKERS = 4


def start(command: list[str], delay_s: float, read_log: Path) -> subprocess.Popen[str]:
    env = {
        "LOADERPLUG_SPAN_BYTES": str(CHUNK),
        "LOADERPLUG_READERS": str(WORKERS),
        "LOADERPLUG_SPLIT_THRESHOLD_BYTES": "512K",  # ranges, not one whole-file read
        # Through the helper even undelayed (1 ns): its log counts the reads.
        "SLOW_HYDRATE_READ_LOG": str(read_log),
    }
    return slowed.start(command, delay_s or 1e-9, env)


def bytes_read(read_log: Path, under: Path) -> int:
    """What was read from files under ``under``, from the helper's log of reads (offset,
    length, path)."""
    if not read_log.exists():
        return 0
    lines = (line.split(maxsplit=2) for line in read_log.read_text().splitlines() if line)
    return sum(int(length) for _, length, path in lines if path.startswith(f"{under}/"))


def landed_fraction(dst: Path, size: int) -> float:
    journal = journal_for(dst)
    if not journal.exists():
        return 0.0
    lines = journal.read_text().splitlines()[1:]
    return sum(int(e) - int(b) for b, e in (line.split() for line in lines if line)) / size


@pytest.fixture
def one_file(tmp_path: Path) -> Path:
    folder = tmp_path / "src"
    write_model(folder, 16 * MiB, shards=1, tensors_per_shard=16)
    for extra in ("model.safetensors.index.json", "config.json"):
        (folder / extra).unlink()
    return folder


@pytest.mark.slow("kills a hydrate half way and runs it again")
@pytest.mark.parametrize("kill_at", [0.2, 0.5, 0.8])
def test_a_killed_hydrate_resumes_reading_only_what_had_not_landed(
    one_file: Path, tmp_path: Path, kill_at: float
) -> None:
    (shard,) = one_file.glob("*.safetensors")
    size = shard.stat().st_size
    local = tmp_path / "local"
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    proc = start(["hydrate", "--from", str(one_file), "--to", str(local)], 0.05, first_log)
    deadline = time.monotonic() + 60
    while landed_fraction(local / shard.name, size) < kill_at:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    landed = read_landed(local / shard.name, Identity.of(shard.stat()))
    assert landed is not None and landed.nbytes >= kill_at * size * 0.9
    proc = start(["hydrate", "--from", str(one_file), "--to", str(local), "--json"], 0, second_log)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert (local / shard.name).read_bytes() == shard.read_bytes()
    assert leftover_temps(local) == []
    # The rerun read what was left, and at most what was in flight at the kill besides.
    in_flight = WORKERS * CHUNK
    assert bytes_read(second_log, one_file) <= size - landed.nbytes + in_flight, json.loads(out)


def test_a_changed_source_starts_over(one_file: Path, tmp_path: Path) -> None:
    (shard,) = one_file.glob("*.safetensors")
    local = tmp_path / "local"
    log = tmp_path / "first.log"
    proc = start(["hydrate", "--from", str(one_file), "--to", str(local)], 0.05, log)
    while landed_fraction(local / shard.name, shard.stat().st_size) < 0.3:
        assert proc.poll() is None
        time.sleep(0.01)
    proc.kill()
    proc.communicate(timeout=30)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # the mirror got a new version of the file (same size)
    shard.write_bytes(bytes(data))
    assert read_landed(local / shard.name, Identity.of(shard.stat())) is None
    second = tmp_path / "second.log"
    proc = start(["hydrate", "--from", str(one_file), "--to", str(local)], 0, second)
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert (local / shard.name).read_bytes() == bytes(data)
    assert bytes_read(second, one_file) >= len(data)  # every byte again: nothing reusable


@pytest.mark.slow("kills a one pass half way and runs it again")
def test_a_killed_one_pass_resumes_and_loads_every_tensor(one_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (shard,) = one_file.glob("*.safetensors")
    size = shard.stat().st_size
    local = tmp_path / "local"
    command = ["load", "--from", str(one_file), "--to", str(local), "--json"]
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    proc = start(command, 0.05, first)
    while landed_fraction(local / shard.name, size) < 0.5:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.kill()
    proc.communicate(timeout=30)
    landed = read_landed(local / shard.name, Identity.of(shard.stat()))
    assert landed is not None
    proc = start(command, 0, second)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(out)["tensors"] == 16
    assert (local / shard.name).read_bytes() == shard.read_bytes()
    # From the source only what was left; the tensors then come from the local copy.
    assert bytes_read(second, one_file) <= size - landed.nbytes + WORKERS * CHUNK
    assert leftover_temps(local) == []


def test_landed_ranges_merge_and_cover() -> None:
    landed = Landed.of([(10, 20), (0, 10), (30, 40), (35, 50)])
    assert landed.ranges == ((0, 20), (30, 50))
    assert landed.covers(0, 20) and landed.covers(32, 10)
    assert not landed.covers(15, 10) and not landed.covers(20, 5) and not landed.covers(0, 0)
    assert landed.nbytes == 40


def test_a_torn_journal_line_is_not_counted(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    identity = Identity.of(src.stat())
    dst = tmp_path / "dst"
    partial = dst.with_name(f".{dst.name}.loaderplug-partial")
    partial.write_bytes(b"\0" * 100)
    header = json.dumps(
        {"size": identity.size, "mtime_ns": identity.mtime_ns, "inode": identity.inode}
    )
    journal_for(dst).write_text(header + "\n0 40\n40 6")  # killed mid-line
    landed = read_landed(dst, identity)
    assert landed is not None and landed.ranges == ((0, 40),)
    os.truncate(partial, 99)  # not the size of the source: start over
    assert read_landed(dst, identity) is None
