"""The IO policy measured per mount: the first cold read measures direct against
buffered, the winner is kept for the mount and used from then on; forced modes, warm
files, small files and LOADERPLUG_IO_PROBE=off keep the table's answer."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from loaderplug.cli.doctor import doctor
from loaderplug.settings import from_env
from loaderplug.storage import io_probe
from loaderplug.storage.io_policy import decide
from loaderplug.storage.mounts import MEMORY_TYPES, filesystem_type
from loaderplug.types import IOPolicy
from loaderplug.units import MiB
from tests.conftest import drop_from_page_cache


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """A cold file the probe can measure with, on this machine's disk."""
    if filesystem_type(tmp_path) in MEMORY_TYPES:
        pytest.skip(f"{tmp_path} is in memory: nothing to measure")
    path = tmp_path / "data" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(noise())
    drop_from_page_cache(path)
    return path


@functools.cache
def noise() -> bytes:
    """Bytes for a file big enough to measure with, made once (they take a while)."""
    return os.urandom(io_probe.SMALLEST_PROBED + 16 * MiB)


def entries() -> dict[str, dict[str, object]]:
    loaded: dict[str, dict[str, object]] = json.loads(io_probe.cache_file().read_text())
    return loaded


def test_the_first_cold_read_measures_the_mount_and_later_ones_use_it(
    big: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = decide(big, "auto", measure=True)
    assert policy.reason.startswith("measured on this mount"), policy.reason
    (entry,) = entries().values()
    assert entry["sample"] == str(big)
    assert float(entry["direct_mib_s"]) > 0 and float(entry["buffered_mib_s"]) > 0  # type: ignore[arg-type]
    assert 0 < int(entry["bytes_read"]) <= io_probe.PROBE_BYTES  # type: ignore[call-overload]
    assert policy.direct == entry["direct"]
    # The probe's buffered half was dropped again: the job finds the file cold.
    assert (io_probe.cached_fraction(str(big)) or 0.0) <= io_probe.COLDEST_PROBED

    def no_second_probe(*args: object) -> None:
        raise AssertionError("the mount was measured already")

    monkeypatch.setattr(io_probe, "probe", no_second_probe)
    small = big.parent / "config.json"
    small.write_text("{}")
    drop_from_page_cache(small)
    again = decide(small, "auto", measure=True)
    assert (again.direct, again.reason) == (policy.direct, policy.reason)


def test_a_small_first_file_is_measured_with_a_big_one_beside_it(big: Path) -> None:
    small = big.parent / "config.json"
    small.write_text("{}")
    drop_from_page_cache(small)
    policy = decide(small, "auto", measure=True)
    assert policy.reason.startswith("measured")
    (entry,) = entries().values()
    assert entry["sample"] == str(big)


@pytest.mark.parametrize(
    ("guess_direct", "direct_s", "buffered_s", "chosen"),
    [
        (True, 1.0, 0.5, False),  # buffered twice as fast: it wins over the guess
        (False, 0.5, 1.0, True),  # direct twice as fast: it wins over the guess
        (True, 1.0, 0.98, True),  # within the margin: the guess stays
        (False, 0.98, 1.0, False),
    ],
)
def test_the_faster_mode_wins_and_a_near_tie_keeps_the_guess(
    big: Path,
    monkeypatch: pytest.MonkeyPatch,
    guess_direct: bool,
    direct_s: float,
    buffered_s: float,
    chosen: bool,
) -> None:
    slices: list[tuple[bool, int]] = []

    def timed(
        path: str, policy: IOPolicy, start: int, length: int, seconds: float
    ) -> tuple[int, float]:
        slices.append((policy.direct, start))
        return 100 * MiB, direct_s if policy.direct else buffered_s

    monkeypatch.setattr(io_probe, "_read_region", timed)
    guess = decide(big, "on" if guess_direct else "off")
    measured = io_probe.probe(str(big), "key", guess, 4096)
    assert measured is not None and measured.direct is chosen
    # The modes take turns (direct, buffered, buffered, direct: a drift weighs on both),
    # over regions spread across the file.
    assert [direct for direct, _ in slices] == [True, False, False, True]
    starts = [start for _, start in slices]
    assert starts == sorted(set(starts)) and starts[-1] >= big.stat().st_size // 2


def test_forced_modes_probing_off_and_warm_files_keep_the_table(
    big: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_probe(*args: object) -> None:
        raise AssertionError("nothing should have been measured")

    monkeypatch.setattr(io_probe, "probe", no_probe)
    assert decide(big, "on", measure=True).reason == "LOADERPLUG_DIRECT_IO=on"
    assert decide(big, "off", measure=True).reason == "LOADERPLUG_DIRECT_IO=off"
    assert not decide(big, "auto", measure=False).reason.startswith("measured")
    big.read_bytes()  # now in the page cache: served from memory, nothing to measure
    assert not decide(big, "auto", measure=True).reason.startswith("measured")
    assert not io_probe.cache_file().exists()


def test_doctor_shows_the_measured_choice(big: Path) -> None:
    said = doctor([str(big)], {"XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"]})
    assert "measured on this mount" in said and "MiB/s" in said
    assert "LOADERPLUG_IO_PROBE=on  (default)" in said
    off = doctor([str(big)], {"LOADERPLUG_IO_PROBE": "0"})
    assert "measured on this mount" not in off.splitlines()[0]


def test_a_hydrate_measures_its_mount_once(big: Path, tmp_path: Path) -> None:
    from loaderplug import hydrate

    settings = from_env({}, io_probe=True, progress=False)
    report = hydrate(big.parent, tmp_path / "local", settings=settings)
    assert report.ok
    (entry,) = entries().values()
    assert entry["sample"] == str(big)
    assert (tmp_path / "local" / big.name).read_bytes() == big.read_bytes()


def test_the_storage_bench_measures_the_mount_again_and_keeps_it(big: Path) -> None:
    from loaderplug.cli.bench import run_bench

    settings = from_env({}, io_probe=True)
    result = run_bench(big.parent, seconds=1, max_bytes=8 * MiB, grid=[(2, MiB)], settings=settings)
    assert result.measured is not None and result.measured.startswith("measured")
    assert "IO policy kept for this mount: measured" in result.summary()
    (entry,) = entries().values()
    assert result.policy.endswith(f"({result.measured})")
    assert entry["sample"] == str(big)
    off = run_bench(big.parent, seconds=1, max_bytes=8 * MiB, grid=[(2, MiB)])
    assert off.measured is None  # LOADERPLUG_IO_PROBE=0 here (conftest)


@pytest.mark.slow("8 processes that each measure a mount")
def test_processes_probing_one_new_mount_at_once_agree_and_leave_one_valid_file(
    big: Path, tmp_path: Path
) -> None:
    """8 processes find the mount unmeasured at once and each measures it (each with a
    cold file of its own: a file another process just read is warm, and a warm file is
    read as the guess says): the first measurement kept is the one every process uses,
    and the file is one valid table."""
    import subprocess
    import sys

    # Each process's measurement says what its index says (a real probe runs first), so
    # processes that each kept their own would disagree.
    code = (
        "import dataclasses, sys\n"
        "from loaderplug.storage import io_probe\n"
        "from loaderplug.storage.io_policy import decide\n"
        "real_probe = io_probe.probe\n"
        "def probe(*args):\n"
        "    found = real_probe(*args)\n"
        "    return dataclasses.replace(found, direct=int(sys.argv[2]) % 2 == 1)\n"
        "io_probe.probe = probe\n"
        "policy = decide(sys.argv[1], 'auto', measure=True)\n"
        "print(policy.direct, policy.reason)\n"
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    files = []
    for i in range(8):
        folder = big.parent.parent / f"data{i}"
        folder.mkdir()
        files.append(big.rename(folder / big.name) if i == 0 else folder / big.name)
        if i:
            files[i].write_bytes(noise())
        drop_from_page_cache(files[i])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(file), str(index)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for index, file in enumerate(files)
    ]
    said = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-500:] for _, err in said]
    answers = {out.strip() for out, _ in said}
    assert len(answers) == 1, answers
    (entry,) = entries().values()
    assert answers == {f"{entry['direct']} {io_probe.Measurement(**entry).reason}"}


@pytest.mark.parametrize("garbage", ["{torn", "[1, 2]", ""])
def test_a_garbage_policy_file_is_ignored_with_a_warning(
    big: Path, garbage: str, caplog: pytest.LogCaptureFixture
) -> None:
    io_probe._warned.clear()
    io_probe.cache_file().parent.mkdir(parents=True)
    io_probe.cache_file().write_text(garbage)
    policy = decide(big, "auto", measure=True)
    assert policy.reason.startswith("measured on this mount")
    assert len(entries()) == 1  # replaced by a valid table
    assert "is not a table of measurements" in caplog.text
