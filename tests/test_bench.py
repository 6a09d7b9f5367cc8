"""``loaderplug bench``: a bounded, read-only sweep that names the best setting."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from loaderplug.cli.bench import run_bench
from loaderplug.cli.commands import main
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import VolumeProfile, mounted
from loaderplug.units import MiB
from tests.conftest import tree_bytes


@pytest.mark.slow("measures a throttled test volume for seconds")
@pytest.mark.fuse
def test_a_per_stream_capped_volume_is_told_to_use_more_streams(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    write_model(backing, 16 * MiB, shards=2)
    before = tree_bytes(backing)
    profile = VolumeProfile(per_stream_bytes_per_s=2 * MiB, mount_bytes_per_s=64 * MiB)
    with mounted(backing, tmp_path / "mnt", profile) as vol:
        grid = [(1, 256 * 1024), (8, 256 * 1024)]
        result = run_bench(vol.mountpoint, seconds=2, max_bytes=64 * MiB, grid=grid)
        stats = vol.stats()
    one, eight = result.trials
    assert eight.mib_per_s > 2 * one.mib_per_s, result.summary()
    assert result.best is eight
    assert "export LOADERPLUG_READERS=8" in result.summary()
    assert "export LOADERPLUG_SPAN_BYTES=256KiB" in result.summary()
    assert "buffered" in result.policy
    # Read-only, and every byte a trial counted came from the volume.
    assert stats["writes"] == 0 and tree_bytes(backing) == before
    assert stats["bytes_read"] == one.bytes_read + eight.bytes_read


def test_the_sweep_stays_within_its_byte_budget(tmp_path: Path) -> None:
    write_model(tmp_path / "model", 8 * MiB, shards=2)
    grid = [(2, 64 * 1024), (4, 64 * 1024)]
    result = run_bench(tmp_path / "model", seconds=30, max_bytes=2 * MiB, grid=grid)
    # Each trial stops at its share: reads are claimed before they start.
    for trial in result.trials:
        assert trial.bytes_read <= 1 * MiB
    # 2 MiB over 8 MiB of files: every trial read bytes no other trial had read.
    assert sum(t.bytes_read for t in result.trials) <= 8 * MiB


def test_transient_errors_are_counted_and_a_clean_setting_preferred(tmp_path: Path, inject) -> None:
    write_model(tmp_path / "model", 8 * MiB, shards=2)
    plugin = inject(errno.ENOMEM, match="model", times=3)
    grid = [(4, 64 * 1024), (1, 64 * 1024)]
    result = run_bench(tmp_path / "model", seconds=1, max_bytes=4 * MiB, grid=grid)
    noisy, clean = result.trials
    assert noisy.transient_errors == plugin.injected == 3
    assert clean.transient_errors == 0 and result.best is clean


def test_the_command_prints_json_and_refuses_bad_budgets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_model(tmp_path / "model", 4 * MiB, shards=1)
    assert main(["bench", str(tmp_path / "model"), "--seconds", "0.5", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert len(figures["trials"]) == 8 and figures["best"]["mib_per_s"] > 0
    assert main(["bench", str(tmp_path / "model"), "--max-bytes", "lots"]) == 2
    assert "--max-bytes='lots' is invalid" in capsys.readouterr().err
    assert main(["bench", str(tmp_path / "missing")]) == 1  # a runtime failure, not usage
    assert "does not exist" in capsys.readouterr().err


def test_a_hard_error_stops_the_bench(tmp_path: Path, inject) -> None:
    from loaderplug.errors import LoaderplugError

    write_model(tmp_path / "model", 4 * MiB, shards=1)
    inject(errno.EACCES, match="model", times=1)
    with pytest.raises(LoaderplugError, match="Permission denied"):
        run_bench(tmp_path / "model", seconds=1, max_bytes=4 * MiB, grid=[(2, 64 * 1024)])


def test_a_snapshot_of_symlinks_is_measured(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    write_model(blobs, 2 * MiB, shards=2)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for blob in blobs.iterdir():
        (snapshot / blob.name).symlink_to(blob)
    result = run_bench(snapshot, seconds=5, max_bytes=1 * MiB, grid=[(2, 64 * 1024)])
    # The links were followed: the trial read (nearly) its whole byte budget from the
    # blobs (spans are not cut to fit the budget's last bytes).
    assert MiB // 2 < result.trials[0].bytes_read <= MiB
