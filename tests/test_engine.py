"""The range engine through hydrate(): retries, per-file failure, identity, cleanup."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from loaderplug import IOPolicy, TransferFailed, hydrate
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.storage.source import PosixSource
from tests.conftest import FAST, leftover_temps, tree_bytes


def test_hydrate_restores_every_file_byte_identical(model: Path, tmp_path: Path) -> None:
    report = hydrate(model, tmp_path / "local", **FAST)
    assert tree_bytes(tmp_path / "local") == tree_bytes(model)
    assert len(report.restored) == 6 and report.bytes_copied == sum(
        len(b) for b in tree_bytes(model).values()
    )
    for rel in tree_bytes(model):
        assert os.stat(tmp_path / "local" / rel).st_mtime_ns == os.stat(model / rel).st_mtime_ns


def test_reads_interleave_across_files(model: Path, tmp_path: Path, inject) -> None:
    spy = inject(errno.EIO, match="", times=0)
    hydrate(model, tmp_path / "local", **{**FAST, "readers": 1})
    shards = [Path(p).name for p, _ in spy.reads if p.endswith(".safetensors")]
    # With one worker the read order is the plan's order: shard 1, 2, 3, 4, 1, 2, ...
    assert shards[:8] == [f"model-{i:05d}-of-00004.safetensors" for i in (1, 2, 3, 4)] * 2


def test_transient_errors_are_retried_and_the_file_is_identical(
    model: Path, tmp_path: Path, inject
) -> None:
    for code, match in (
        (errno.ENOMEM, "00001"),
        (errno.EIO, "00002"),
        (errno.EAGAIN, "00003"),
        (errno.ESTALE, "model-00004"),  # a stale handle: each retry opens the path again
    ):
        inject(code, match=match, times=3)
    report = hydrate(model, tmp_path / "local", **FAST)
    assert report.retries == 12
    assert tree_bytes(tmp_path / "local") == tree_bytes(model)


def test_non_transient_error_fails_that_file_only(model: Path, tmp_path: Path, inject) -> None:
    plugin = inject(errno.EACCES, match="00002", times=1, at_offset=64 << 10)
    report = hydrate(model, tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == ["model-00002-of-00004.safetensors"]
    failure = report.failed[0]
    # Which range past the first fails depends on which worker gets there first.
    assert failure.errno == errno.EACCES and failure.range is not None
    assert failure.range[0] >= 64 << 10 and failure.range[1] == 64 << 10
    assert "Permission denied" in failure.reason
    assert plugin.injected == 1  # not retried
    local = tree_bytes(tmp_path / "local")
    assert "model-00002-of-00004.safetensors" not in local
    assert {k: v for k, v in tree_bytes(model).items() if "00002" not in k} == local
    assert leftover_temps(tmp_path / "local") == []


def test_persistently_failing_file_exhausts_retries_and_others_land(
    model: Path, tmp_path: Path, inject
) -> None:
    plugin = inject(errno.ENOMEM, match="00003")
    with pytest.raises(TransferFailed) as info:
        hydrate(model, tmp_path / "local", retry_attempts=5, **FAST)
    report = info.value.report
    assert [r.path for r in report.failed] == ["model-00003-of-00004.safetensors"]
    assert "after 5 attempts" in report.failed[0].reason
    assert report.failed[0].errno == errno.ENOMEM
    # Remaining ranges of the failed file were skipped, not attempted.
    assert plugin.injected < 5 * 8
    assert len(report.restored) == 5
    assert leftover_temps(tmp_path / "local") == []


def test_failed_hydrate_leaves_an_existing_local_copy_untouched(
    model: Path, tmp_path: Path, inject
) -> None:
    local = tmp_path / "local"
    hydrate(model, local, **FAST)
    shard = "model-00001-of-00004.safetensors"
    before = (local / shard).read_bytes()
    # The mirror gets a new version of the shard; copying it fails.
    with open(model / shard, "r+b") as f:
        f.seek(1000)
        f.write(b"new version")
    inject(errno.EACCES, match="00001")
    report = hydrate(model, local, check=False, **FAST)
    assert [r.path for r in report.failed] == [shard]
    assert (local / shard).read_bytes() == before
    assert leftover_temps(local) == []


def test_second_hydrate_is_a_no_op(model: Path, tmp_path: Path, inject) -> None:
    hydrate(model, tmp_path / "local", **FAST)
    spy = inject(errno.EIO, match="", times=0)
    report = hydrate(model, tmp_path / "local", **FAST)
    assert spy.reads == [] and report.bytes_copied == 0
    assert len(report.skipped) == 6
    assert "nothing to do" in report.summary()


def test_changed_size_or_mtime_is_copied_again(model: Path, tmp_path: Path) -> None:
    hydrate(model, tmp_path / "local", **FAST)
    os.utime(model / "config.json", ns=(1, 1))
    report = hydrate(model, tmp_path / "local", **FAST)
    assert [r.path for r in report.restored] == ["config.json"]


def test_source_truncated_after_listing_is_refused(
    model: Path, tmp_path: Path, register_plugin
) -> None:
    # The source is truncated after it was listed (identity pinned), before its reads.
    shard = model / "model-00004-of-00004.safetensors"
    size = shard.stat().st_size

    class Truncate:
        done = False

        @hookimpl(hookwrapper=True)
        def loaderplug_open_source(self, path: str, policy: IOPolicy):  # type: ignore[no-untyped-def]
            if path == str(shard) and not self.done:
                self.done = True
                os.truncate(shard, size // 2)
            yield

    plugin = Truncate()
    register_plugin(plugin)
    report = hydrate(model, tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == [shard.name]
    assert "source changed while being copied" in report.failed[0].reason
    assert not (tmp_path / "local" / shard.name).exists()
    assert leftover_temps(tmp_path / "local") == []


class ShortSource(PosixSource):
    """A backend that reports the full size but runs out of bytes half-way."""

    def pread_into(self, buf: memoryview, offset: int) -> int:
        limit = self.size // 2
        if offset >= limit:
            return 0
        return super().pread_into(buf[: limit - offset], offset)


def test_a_source_that_ends_early_is_refused_not_zero_padded(
    model: Path, tmp_path: Path, register_plugin
) -> None:
    class Short:
        @hookimpl
        def loaderplug_open_source(self, path: str, policy: IOPolicy) -> ShortSource | None:
            return ShortSource(path, policy) if "00003" in path else None

    plugin = Short()
    register_plugin(plugin)
    report = hydrate(model, tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == ["model-00003-of-00004.safetensors"]
    assert "source is shorter than expected" in report.failed[0].reason
    assert not (tmp_path / "local" / "model-00003-of-00004.safetensors").exists()


def test_full_destination_fails_clearly_and_publishes_nothing(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    from loaderplug.testing.model import write_model

    mirror = tmp_path / "big"
    write_model(mirror, 12 << 20, shards=3)  # three ~4 MiB shards; the tmpfs holds 4 MiB
    report = hydrate(mirror, small_tmpfs / "local", check=False, **FAST)
    assert report.failed, report.summary()
    for failure in report.failed:
        assert failure.errno == errno.ENOSPC
        assert "cannot reserve" in failure.reason and "No space left on device" in failure.reason
        assert "free some space there" in failure.reason
    for rel in tree_bytes(small_tmpfs / "local"):
        assert (small_tmpfs / "local" / rel).read_bytes() == (mirror / rel).read_bytes()
    assert leftover_temps(small_tmpfs) == []


def test_temp_files_of_a_killed_run_are_swept(model: Path, tmp_path: Path) -> None:
    local = tmp_path / "local" / "sub"
    local.mkdir(parents=True)
    stale = local / ".model-00001-of-00004.safetensors.abc123.loaderplug-tmp"
    stale.write_bytes(b"partial")
    hydrate(model, tmp_path / "local", **FAST)
    assert not stale.exists()


def test_an_explicit_chunk_is_kept_and_the_budget_limits_the_workers(
    model: Path, tmp_path: Path
) -> None:
    report = hydrate(
        model, tmp_path / "local", span_bytes="1M", bytes_in_flight="2M", progress=False
    )
    assert report.readers == 2 and report.span_bytes == 1 << 20
    assert tree_bytes(tmp_path / "local") == tree_bytes(model)


@pytest.mark.parametrize("direct_io", ["auto", "on", "off"])
@pytest.mark.parametrize("chunk", ["64K", "5000"])
def test_direct_and_buffered_writes_give_identical_files(
    model: Path, tmp_path: Path, direct_io: str, chunk: str
) -> None:
    # 64 KiB ranges are aligned (direct writes, buffered tails); 5000-byte ranges are
    # not, so every write past the first goes through the page cache.
    settings = {**FAST, "span_bytes": chunk, "direct_io": direct_io}
    hydrate(model, tmp_path / "local", **settings)
    assert tree_bytes(tmp_path / "local") == tree_bytes(model)


def test_direct_writes_refused_by_the_filesystem_fall_back(model: Path, small_tmpfs: Path) -> None:
    hydrate(model, small_tmpfs / "local", **{**FAST, "direct_io": "on"})
    assert tree_bytes(small_tmpfs / "local") == tree_bytes(model)
