"""The ``loaderplug`` command as a user runs it."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from loaderplug.jobs.model_folder import is_own_name
from loaderplug.units import MiB
from tests.conftest import tree_bytes

REPO = Path(__file__).resolve().parent.parent
# As in every test (see conftest): no measured IO policy decides these commands.
NO_PROBE = {"LOADERPLUG_IO_PROBE": "0"}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loaderplug", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **NO_PROBE, **(env or {})},
        timeout=120,
    )


def test_hydrate_prints_a_report_and_exits_zero(model: Path, tmp_path: Path) -> None:
    done = run("hydrate", "--from", str(model), "--to", str(tmp_path / "l"), "--workers", "32")
    assert done.returncode == 0, done.stderr
    # 32 workers share 512 MiB in flight (16 MiB each); a 2 MiB model gets 4 MiB ranges.
    assert "6 restored" in done.stdout and "32 readers x 4 MiB spans" in done.stdout
    assert tree_bytes(tmp_path / "l") == tree_bytes(model)


def test_json_report(model: Path, tmp_path: Path) -> None:
    done = run(
        "hydrate",
        "--from",
        str(model),
        "--to",
        str(tmp_path / "l"),
        "--chunk-bytes",
        "64K",
        "--bytes-in-flight",
        "256K",
        "--json",
    )
    report = json.loads(done.stdout)
    assert report["restored"] == 6 and report["failed"] == 0
    assert report["readers"] == 4 and report["span_bytes"] == 65536
    assert report["bytes_copied"] == sum(len(b) for b in tree_bytes(model).values())


def test_failed_file_exits_non_zero_and_names_it(model: Path, tmp_path: Path) -> None:
    (model / "escape").symlink_to("../../etc")
    done = run("hydrate", "--from", str(model), "--to", str(tmp_path / "l"))
    assert done.returncode == 1
    assert "FAILED escape: symlink to ../../etc escapes the tree" in done.stdout


def test_bad_setting_exits_2_with_the_message(model: Path, tmp_path: Path) -> None:
    done = run(
        "hydrate",
        "--from",
        str(model),
        "--to",
        str(tmp_path / "l"),
        env={"LOADERPLUG_BYTES_IN_FLIGHT": "lots"},
    )
    assert done.returncode == 2
    assert "LOADERPLUG_BYTES_IN_FLIGHT='lots' is invalid" in done.stderr
    assert "Traceback" not in done.stderr


def test_sync_then_hydrate(model: Path, tmp_path: Path) -> None:
    assert run("sync", "--from", str(model), "--to", str(tmp_path / "m")).returncode == 0
    done = run("hydrate", "--from", str(tmp_path / "m"), "--to", str(tmp_path / "l"))
    assert done.returncode == 0
    assert tree_bytes(tmp_path / "l") == tree_bytes(model)


def test_second_run_says_nothing_to_do(model: Path, tmp_path: Path) -> None:
    run("hydrate", "--from", str(model), "--to", str(tmp_path / "l"))
    done = run("hydrate", "--from", str(model), "--to", str(tmp_path / "l"))
    assert "nothing to do" in done.stdout and "6 skipped" in done.stdout


def run_on_a_terminal(*args: str, env: dict[str, str]) -> str:
    """Run the CLI with stderr on a pseudo-terminal; returns what the terminal showed."""
    controller, terminal = pty.openpty()
    # A new pty is 0 columns wide, where tqdm would draw an empty bar.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "loaderplug", *args],
        stdout=subprocess.DEVNULL,
        stderr=terminal,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **NO_PROBE, **env},
    )
    os.close(terminal)
    shown = b""
    while True:
        try:
            data = os.read(controller, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        shown += data
    proc.wait(timeout=60)
    os.close(controller)
    return shown.decode(errors="replace")


def test_progress_bar_shows_on_a_terminal_only(model: Path, tmp_path: Path) -> None:
    args = ("hydrate", "--from", str(model), "--chunk-bytes", "64K")
    shown = run_on_a_terminal(*args, "--to", str(tmp_path / "a"), env={})
    assert "100%" in shown and "hydrate mirror" in shown
    off = run_on_a_terminal(*args, "--to", str(tmp_path / "b"), env={"LOADERPLUG_PROGRESS": "0"})
    assert "100%" not in off
    piped = run("hydrate", "--from", str(model), "--to", str(tmp_path / "c"))
    assert "100%" not in piped.stderr


def test_bad_flag_is_named_as_a_flag(model: Path, tmp_path: Path) -> None:
    done = run("hydrate", "--from", str(model), "--to", str(tmp_path / "l"), "--workers", "0")
    assert done.returncode == 2
    assert "--readers='0' is invalid: expected auto, or an integer from 1 to 512" in done.stderr


def test_doctor_shows_each_decision_and_where_settings_came_from(tmp_path: Path) -> None:
    done = run("doctor", str(tmp_path), "/dev/shm", env={"LOADERPLUG_READERS": "4"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].startswith("/dev/shm: tmpfs") and "buffered" in lines[1]
    assert "LOADERPLUG_READERS=4  (environment)" in done.stdout
    assert "LOADERPLUG_BYTES_IN_FLIGHT=512 MiB  (default)" in done.stdout
    (hosts,) = [line for line in lines if line.startswith("hosts:")]
    assert "told apart by name" in hosts and "splits the mirror's reads while the exchange" in hosts


def test_doctor_says_how_hosts_are_known_and_whether_they_split(tmp_path: Path) -> None:
    torchrun = {"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "8"}
    done = run("doctor", str(tmp_path), env={**torchrun, "LOADERPLUG_HOST_SPLIT": "off"})
    assert done.returncode == 0, done.stderr
    (hosts,) = [line for line in done.stdout.splitlines() if line.startswith("hosts:")]
    assert "torchrun node 1 of 2, 8 rank(s) here" in hosts
    assert "every host reads the whole model (LOADERPLUG_HOST_SPLIT=off)" in hosts


def test_doctor_speaks_the_environments_language(tmp_path: Path) -> None:
    """Settings as they are written in the environment, and a misspelt variable said in
    one line, with no Python file path."""
    env = {"LOADERPLUG_IO_PROBE": "0", "LOADERPLUG_REDERS": "4"}
    done = run("doctor", str(tmp_path), env=env)
    assert done.returncode == 0, done.stderr
    assert "LOADERPLUG_IO_PROBE=off  (environment)" in done.stdout
    assert "LOADERPLUG_FSYNC=on  (default)" in done.stdout
    assert "LOADERPLUG_HOST_ID=unset  (default)" in done.stdout
    assert "None" not in done.stdout and "True" not in done.stdout
    (warning,) = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    assert "LOADERPLUG_REDERS" in warning and "LOADERPLUG_READERS" in warning
    assert ".py" not in done.stdout + done.stderr


@pytest.mark.slow("CLI processes that import torch")
def test_load_hydrates_and_loads_in_one_pass(model: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done = run("load", "--from", str(model), "--to", str(tmp_path / "l"), "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["tensors"] == 16  # 4 shards x 4 tensors
    assert figures["first_tensor_s"] <= figures["seconds"]
    assert all("direct" in mode or "buffered" in mode for mode in figures["io"].values())
    shards = sorted(model.glob("*.safetensors"))
    # The shards, and loaderplug's lock beside them (a one pass publishes under it).
    published = sorted(p.name for p in (tmp_path / "l").iterdir() if not is_own_name(p.name))
    assert published == [p.name for p in shards]
    assert all((tmp_path / "l" / p.name).read_bytes() == p.read_bytes() for p in shards)


@pytest.mark.slow("CLI processes that import torch")
def test_load_says_what_it_read_and_what_it_only_mapped(model: Path) -> None:
    """A warm local file (a local copy of loaderplug's own, or the user's) is handed
    over as a mapping: reported as mapped, with its bytes, never as bytes read at some
    speed; one the load must own (LOADERPLUG_OWNED=own), or a cold one read direct, is
    read, and reported as read."""
    pytest.importorskip("torch")
    from tests.conftest import drop_from_page_cache

    shards = sorted(model.glob("*.safetensors"))
    size = sum(s.stat().st_size for s in shards)
    for shard in shards:
        shard.read_bytes()  # warm
    own = {"LOADERPLUG_DIRECT_IO": "off", "LOADERPLUG_LOCAL_COPIES": str(model)}
    warm = run("load", *map(str, shards), env=own)
    assert warm.returncode == 0, warm.stderr
    assert "read nothing" in warm.stdout and f"mapped {size / MiB:.1f} MiB" in warm.stdout
    assert "MiB/s" not in warm.stdout
    figures = json.loads(run("load", *map(str, shards), "--json", env=own).stdout)
    assert (figures["bytes_read"], figures["bytes_mapped"]) == (0, size)
    users = json.loads(
        run("load", *map(str, shards), "--json", env={"LOADERPLUG_DIRECT_IO": "off"}).stdout
    )
    assert (users["bytes_read"], users["bytes_mapped"]) == (0, size)
    owned = {"LOADERPLUG_DIRECT_IO": "off", "LOADERPLUG_OWNED": "own"}
    users = json.loads(run("load", *map(str, shards), "--json", env=owned).stdout)
    assert (users["bytes_read"], users["bytes_mapped"]) == (size, 0)
    for shard in shards:
        drop_from_page_cache(shard)
    cold = run("load", *map(str, shards), "--json", env={"LOADERPLUG_DIRECT_IO": "on"})
    figures = json.loads(cold.stdout)
    # Cold and read direct: read at the disk's speed, into memory of the load's own.
    assert figures["bytes_mapped"] == 0 and figures["bytes_read"] == size
    assert not any(mode.startswith("mapped") for mode in figures["io"].values())


@pytest.mark.slow("a CLI process that imports torch")
def test_load_of_a_folder_loads_its_safetensors_files(model: Path) -> None:
    pytest.importorskip("torch")
    figures = json.loads(run("load", str(model), "--json").stdout)
    assert figures["tensors"] == 16  # 4 shards x 4 tensors
    assert sorted(figures["io"]) == sorted(map(str, model.glob("*.safetensors")))


@pytest.mark.slow("a CLI process that imports torch")
def test_load_of_a_corrupt_file_exits_1_with_the_format_error(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]")
    done = run("load", str(bad))
    assert done.returncode == 1  # the job failed; 2 is for bad usage and settings
    assert "header is list, expected a JSON object" in done.stderr


def test_exit_codes_say_done_failed_usage(model: Path, tmp_path: Path) -> None:
    assert run("hydrate", "--from", str(model), "--to", str(tmp_path / "l")).returncode == 0
    missing = run("hydrate", "--from", str(tmp_path / "absent"), "--to", str(tmp_path / "m"))
    assert missing.returncode == 1 and "is not a folder" in missing.stderr
    bad_flag = run("hydrate", "--from", str(model), "--to", str(tmp_path / "m"), "--workers", "x")
    assert bad_flag.returncode == 2 and "--readers='x' is invalid" in bad_flag.stderr
    unknown = run("hydrate", "--from", str(model))  # --to missing: argparse's own usage error
    assert unknown.returncode == 2
