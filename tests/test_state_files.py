"""The files loaderplug keeps for itself beside a model (its lock, the sync mark, the
manifest, a copy's journal, the IO-policy cache) where someone else may have put
something first: a link to a file of the user's, a FIFO, a device. Each is refused at
once with an error that names it; what a link points to is never written; no run hangs.

Every job runs as users run it, the command in a process of its own: a run that hangs
fails its test when the process is stopped at RUN_LIMIT_S.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from loaderplug.engine.spans import Landed
from loaderplug.jobs.model_folder import LOCK_NAME, MANIFEST_NAME, SYNC_MARK_NAME
from loaderplug.jobs.partial import journal_for, partial_for, read_landed
from loaderplug.storage import io_probe
from loaderplug.storage.io_policy import decide
from loaderplug.storage.mounts import MEMORY_TYPES, filesystem_type
from loaderplug.types import Identity
from loaderplug.units import MiB
from tests.conftest import drop_from_page_cache, tree_bytes
from tests.helpers.cli import run_cli

REPO = Path(__file__).resolve().parent.parent
# Far longer than any of these runs takes; what it catches is a run that never ends.
RUN_LIMIT_S = 120
# A run that reads a device into memory stops here rather than take the machine's.
MEMORY_LIMIT = 4 << 30
SECRET = b"-----BEGIN OPENSSH PRIVATE KEY-----\nnot a real key\n"


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def loaderplug(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=RUN_LIMIT_S, preexec_fn=_limited)


def copy_job(job: str, model: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``job``'s source and destination: a sync copies ``model`` to a mirror, a hydrate
    copies a mirror (``model``) to local disk."""
    return model, tmp_path / ("synced" if job == "sync" else "local")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file of the user's that a planted link points at."""
    path = tmp_path / "home" / ".ssh" / "id_ed25519"
    path.parent.mkdir(parents=True)
    path.write_bytes(SECRET)
    return path


@pytest.mark.parametrize("job", ["sync", "hydrate"])
def test_a_link_planted_as_the_lock_is_refused_and_its_target_left_as_it_was(
    job: str, model: Path, tmp_path: Path, victim: Path
) -> None:
    src, dst = copy_job(job, model, tmp_path)
    dst.mkdir()
    (dst / LOCK_NAME).symlink_to(victim)
    done = loaderplug(job, "--from", str(src), "--to", str(dst))
    assert done.returncode == 1, done.stdout
    assert f"{dst / LOCK_NAME}: a symbolic link, not a regular file" in done.stderr
    assert victim.read_bytes() == SECRET
    assert not (dst / "config.json").exists()  # nothing is copied without the lock


def test_a_fifo_planted_as_the_lock_is_refused_at_once(model: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "synced"
    mirror.mkdir()
    os.mkfifo(mirror / LOCK_NAME)
    done = loaderplug("sync", "--from", str(model), "--to", str(mirror))
    assert done.returncode == 1
    assert f"{mirror / LOCK_NAME}: a FIFO, not a regular file" in done.stderr


@pytest.mark.parametrize("job", ["sync", "hydrate"])
def test_a_fifo_planted_as_the_sync_mark_is_refused_at_once(
    job: str, model: Path, tmp_path: Path
) -> None:
    src, dst = copy_job(job, model, tmp_path)
    mirror = dst if job == "sync" else src
    mirror.mkdir(exist_ok=True)
    os.mkfifo(mirror / SYNC_MARK_NAME)
    try:
        done = loaderplug(job, "--from", str(src), "--to", str(dst))
    finally:
        (mirror / SYNC_MARK_NAME).unlink()
    assert done.returncode == 1
    assert f"{mirror / SYNC_MARK_NAME}: a FIFO, not a regular file" in done.stderr


def test_a_fifo_planted_as_the_manifest_is_refused_at_once(model: Path, tmp_path: Path) -> None:
    os.mkfifo(model / MANIFEST_NAME)
    done = loaderplug("hydrate", "--from", str(model), "--to", str(tmp_path / "local"))
    assert done.returncode == 1
    assert f"manifest {model / MANIFEST_NAME}: a FIFO, not a regular file" in done.stderr


def test_a_manifest_linked_to_a_device_is_refused_unread(model: Path, tmp_path: Path) -> None:
    (model / MANIFEST_NAME).symlink_to("/dev/zero")
    done = loaderplug("hydrate", "--from", str(model), "--to", str(tmp_path / "local"))
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"manifest {model / MANIFEST_NAME}: a symbolic link" in done.stderr


def test_a_manifest_larger_than_its_mirror_can_need_is_refused_unread(
    model: Path, tmp_path: Path
) -> None:
    # Valid JSON, and empty: padded out far past what six files can be listed in.
    padded = json.dumps({"version": 1, "files": {}, "symlinks": {}}) + " " * (4 << 20)
    (model / MANIFEST_NAME).write_text(padded)
    done = loaderplug("hydrate", "--from", str(model), "--to", str(tmp_path / "local"))
    assert done.returncode == 1
    assert f"{len(padded)} bytes, larger than the manifest of this mirror can be" in done.stderr


def test_a_sync_writes_its_manifest_over_whatever_was_planted_there(
    model: Path, tmp_path: Path, victim: Path
) -> None:
    mirror = tmp_path / "synced"
    mirror.mkdir()
    (mirror / MANIFEST_NAME).symlink_to(victim)
    done = loaderplug("sync", "--from", str(model), "--to", str(mirror))
    assert done.returncode == 0, done.stderr
    assert victim.read_bytes() == SECRET
    assert not (mirror / MANIFEST_NAME).is_symlink()
    assert "config.json" in json.loads((mirror / MANIFEST_NAME).read_text())["files"]


def test_a_fifo_left_as_a_journal_is_not_waited_on(model: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    os.mkfifo(journal_for(local / "config.json"))
    done = loaderplug("hydrate", "--from", str(model), "--to", str(local))
    assert done.returncode == 0, done.stderr
    assert (local / "config.json").read_bytes() == (model / "config.json").read_bytes()


def test_a_journal_reached_through_a_link_is_not_resumed(tmp_path: Path) -> None:
    source = tmp_path / "volume" / "w.bin"
    source.parent.mkdir()
    source.write_bytes(bytes(4096))
    identity = Identity.of(source.stat())
    dst = tmp_path / "local" / "w.bin"
    dst.parent.mkdir()
    partial_for(dst).write_bytes(bytes(4096))
    elsewhere = tmp_path / "elsewhere"
    fields = {"size": identity.size, "mtime_ns": identity.mtime_ns, "inode": identity.inode}
    elsewhere.write_text(json.dumps(fields) + "\n0 4096\n")
    journal_for(dst).symlink_to(elsewhere)
    assert read_landed(dst, identity) is None
    journal_for(dst).unlink()
    os.replace(elsewhere, journal_for(dst))  # the same journal, as a file of its own
    assert read_landed(dst, identity) == Landed(((0, 4096),))


SWAP_FOR_A_FIFO = """
import json, os, sys
import loaderplug
from loaderplug import hookimpl

class SwapForAFifo:
    # Asked for the source's IO policy: after the mirror was listed, before it is read.
    @hookimpl
    def loaderplug_io_policy(self, path, mode, settings):
        source = os.path.join(sys.argv[1], "config.json")
        if os.fspath(path) == source and not os.path.exists(source + ".old"):
            os.rename(source, source + ".old")
            os.mkfifo(source)
        return None

loaderplug.register(SwapForAFifo())
report = loaderplug.hydrate(sys.argv[1], sys.argv[2], check=False, readers=1)
print(json.dumps({r.path: r.reason for r in report.failed}))
"""


def test_a_source_swapped_for_a_fifo_after_listing_fails_without_hanging(
    model: Path, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    done = subprocess.run(
        [sys.executable, "-c", SWAP_FOR_A_FIFO, str(model), str(local)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LOADERPLUG_IO_PROBE": "0"},
        timeout=RUN_LIMIT_S,
    )
    assert done.returncode == 0, done.stderr
    failed = json.loads(done.stdout)
    assert list(failed) == ["config.json"]
    assert "a FIFO, not a regular file" in failed["config.json"]
    assert not (local / "config.json").exists()
    others = {rel: data for rel, data in tree_bytes(model).items() if "config.json" not in rel}
    assert {rel: data for rel, data in tree_bytes(local).items() if rel in others} == others


@pytest.fixture
def cold_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cold file big enough for the IO probe to measure its mount with, and a cache of
    measurements of this test's own."""
    if filesystem_type(tmp_path) in MEMORY_TYPES:
        pytest.skip(f"{tmp_path} is in memory: nothing to measure")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "data" / "model.safetensors"
    path.parent.mkdir()
    path.write_bytes(os.urandom(io_probe.SMALLEST_PROBED + 16 * MiB))
    drop_from_page_cache(path)
    return path


def test_the_io_policy_cache_writes_through_no_planted_link(cold_file: Path, victim: Path) -> None:
    cache = io_probe.cache_file()
    cache.parent.mkdir(parents=True)
    # Its lock, a link to where no file is (opening it would make one); its temp file,
    # a link to a file of the user's (writing it would replace what it holds).
    nowhere = victim.parent / "authorized_keys"
    cache.with_name(f".{cache.name}.lock").symlink_to(nowhere)
    cache.with_name(f".{cache.name}.{os.getpid()}.tmp").symlink_to(victim)
    policy = decide(cold_file, "auto", measure=True)
    assert policy.reason.startswith("measured on this mount"), policy.reason
    assert victim.read_bytes() == SECRET
    assert not nowhere.exists()
    # Kept once the lock is a file of its own again: through the temp file's link too.
    cache.with_name(f".{cache.name}.lock").unlink()
    io_probe.remeasure(str(cold_file), policy, 4096)
    assert victim.read_bytes() == SECRET
    assert len(json.loads(cache.read_text())) == 1 and not cache.is_symlink()
