"""What a copy's destination gets: the source's permission bits, a clear word when it is
a file, and a read-only one that already holds a current copy is fine."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loaderplug import DestinationError, hydrate, sync
from tests.conftest import FAST, tree_bytes


def test_copies_keep_the_source_permission_bits_without_setuid_within_the_umask(
    model: Path, tmp_path: Path
) -> None:
    private, script = model / "config.json", model / "run.sh"
    private.chmod(0o600)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o4755)  # setuid: never carried over
    old = os.umask(0o027)
    try:
        hydrate(model, tmp_path / "local", **FAST)
        sync(tmp_path / "local", tmp_path / "synced", **FAST)
    finally:
        os.umask(old)
    for root in (tmp_path / "local", tmp_path / "synced"):
        assert stat.S_IMODE((root / "config.json").stat().st_mode) == 0o600
        assert stat.S_IMODE((root / "run.sh").stat().st_mode) == 0o750  # 0755 within 027
        shard = next(root.glob("*.safetensors"))
        assert stat.S_IMODE(shard.stat().st_mode) == 0o640  # 0644 within 027


def test_a_destination_that_is_a_file_or_under_one_says_so(model: Path, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(DestinationError, match=r"afile is a file, not a folder"):
        hydrate(model, afile, **FAST)
    with pytest.raises(DestinationError, match=r"is under .*afile, which is a file"):
        hydrate(model, afile / "deeper" / "local", **FAST)
    assert afile.read_text() == "x"


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    """A folder remounted read-only (a bind mount: needs root)."""
    folder = tmp_path / "ro"
    folder.mkdir()
    done = subprocess.run(["mount", "--bind", str(folder), str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here (needs root): {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def remount(folder: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,bind,{mode}", str(folder)], check=True)


def test_a_read_only_destination_holding_a_current_copy_succeeds(
    model: Path, read_only: Path
) -> None:
    hydrate(model, read_only / "local", **FAST)
    remount(read_only, "ro")
    report = hydrate(model, read_only / "local", **FAST)
    assert report.ok and {r.status for r in report.results} == {"skipped"}
    (model / "config.json").write_text('{"changed": true}')
    with pytest.raises(DestinationError, match=r"cannot be written .* config.json"):
        hydrate(model, read_only / "local", **FAST)
    assert tree_bytes(read_only / "local")["config.json"] != b'{"changed": true}'
