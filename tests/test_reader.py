"""The streaming reader: tensors equal to safetensors', streamed, owned, and one-pass."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path

import pytest

from loaderplug import FormatError, TransferFailed, hookimpl, io_policy
from loaderplug.storage.source import PosixSource
from loaderplug.types import IOPolicy
from tests.conftest import FAST

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
from loaderplug.tensors.reader import iter_tensors, load_file  # noqa: E402
from tests.conftest import drop_from_page_cache  # noqa: E402
from tests.helpers.tensors import STREAMED, mapped_from, reference, same  # noqa: E402


def every_dtype_model(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for i, dtype in enumerate(safetensors_torch._TYPES.values()):
        raw = torch.randint(0, 256, (37 * (i + 1),), dtype=torch.uint8)
        size = (
            dtype.itemsize
            if hasattr(dtype, "itemsize")
            else torch.tensor([], dtype=dtype).element_size()
        )
        tensors[f"t.{dtype}"] = raw[: raw.numel() // size * size].view(dtype)
    tensors["empty"] = torch.empty(0, 4)
    safetensors_torch.save_file(tensors, str(path))
    return tensors


def test_load_file_equals_safetensors_for_every_dtype(tmp_path: Path) -> None:
    path = tmp_path / "all.safetensors"
    every_dtype_model(path)
    expected = safetensors_torch.load_file(str(path))
    got = load_file(path)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert same(got[name], tensor), name


def test_tensors_crossing_range_boundaries_are_assembled(shards: list[Path]) -> None:
    # 4 KiB ranges: every weight spans several ranges, most ranges hold parts of two.
    got = dict(iter_tensors(shards, **STREAMED))
    expected = reference(shards)
    assert sorted(got) == sorted(expected)
    assert all(same(got[k], v) for k, v in expected.items())


def test_yielded_tensors_own_their_memory(shards: list[Path]) -> None:
    got = list(iter_tensors(shards, **STREAMED))
    for name, tensor in got:
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
    expected = reference(shards)  # later ranges did not overwrite earlier tensors
    assert all(same(t, expected[n]) for n, t in got)


class SlowSource(PosixSource):
    def pread_into(self, buf: memoryview, offset: int) -> int:
        time.sleep(0.01)
        return super().pread_into(buf, offset)


def test_first_tensor_arrives_before_the_last_range_lands(
    shards: list[Path], register_plugin
) -> None:
    events: list[str] = []
    lock = threading.Lock()

    class Observe:
        @hookimpl
        def loaderplug_open_source(self, path: str, policy: IOPolicy) -> SlowSource:
            return SlowSource(path, policy)

        @hookimpl
        def loaderplug_on_span_done(
            self, job: str, path: str, offset: int, length: int, retries: int
        ) -> None:
            with lock:
                events.append("range")

    plugin = Observe()
    register_plugin(plugin)
    for _name, _tensor in iter_tensors(shards, **{**STREAMED, "readers": 2}):
        with lock:
            events.append("tensor")
    first_tensor = events.index("tensor")
    last_range = len(events) - 1 - events[::-1].index("range")
    assert first_tensor < last_range, "tensors were held back until every range had landed"
    assert events.count("range") > 20


def test_one_pass_hydrates_and_loads_with_retried_faults(
    shards: list[Path], tmp_path: Path, inject
) -> None:
    inject(errno.EIO, match="model-1", times=3, at_offset=8192)  # past the header
    load = iter_tensors(shards, local_dir=tmp_path / "local", **FAST)
    got = dict(load)
    expected = reference(shards)
    assert all(same(got[k], v) for k, v in expected.items())
    for p in shards:
        assert (tmp_path / "local" / p.name).read_bytes() == p.read_bytes()
    assert load.report is not None and load.report.retries == 3


def test_one_pass_failure_names_the_file_and_never_yields_a_partial_tensor(
    shards: list[Path], tmp_path: Path, inject
) -> None:
    inject(errno.EACCES, match="model-2", at_offset=8192)
    expected = reference(shards)
    seen: dict[str, torch.Tensor] = {}
    with pytest.raises(TransferFailed) as info:
        for name, tensor in iter_tensors(
            shards,
            local_dir=tmp_path / "local",
            **{**FAST, "span_bytes": "4K", "split_threshold_bytes": 0},
        ):
            seen[name] = tensor
    assert "model-2.safetensors" in str(info.value)
    assert all(same(t, expected[n]) for n, t in seen.items())
    assert not (tmp_path / "local" / "model-2.safetensors").exists()


def test_a_corrupt_header_is_a_format_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(FormatError, match="exceeds the 100000000-byte limit"):
        load_file(bad)


def test_an_owned_load_reads_a_users_file_in_the_page_cache_never_maps_it(
    shards: list[Path],
) -> None:
    """With LOADERPLUG_OWNED=own no one can shrink a file under its tensors (a SIGBUS
    then): they are read into the load's own memory, with no engine to hand them over."""
    for p in shards:
        p.read_bytes()  # warm
    load = iter_tensors(shards, progress=False, owned="own")
    got = dict(load)
    assert all(m.startswith("read in the consumer's thread") for m in load.io_modes.values())
    for name, tensor in got.items():
        assert mapped_from(tensor) is None, name
    expected = reference(shards)
    assert all(same(got[k], v) for k, v in expected.items())
    assert load.report is not None
    assert load.report.bytes_copied == sum(p.stat().st_size for p in shards)


def test_an_own_local_copy_in_the_page_cache_is_mapped_not_copied(shards: list[Path]) -> None:
    for p in shards:
        p.read_bytes()  # warm
    load = iter_tensors(shards, progress=False, local_copies=str(shards[0].parent))
    got = dict(load)
    assert all(mode.startswith("mapped") for mode in load.io_modes.values())
    expected = reference(shards)
    assert all(same(got[k], v) for k, v in expected.items())


def test_load_file_streams_a_cold_file_read_direct(shards: list[Path]) -> None:
    drop_from_page_cache(shards[0])
    policy = io_policy(str(shards[0]))
    if not policy.direct:  # tmpfs, say: its files are in memory, and mapped
        pytest.skip(f"{policy.fs_type} here is not read direct: {policy.reason}")
    load = iter_tensors(shards[:1], progress=False)
    got = dict(load)
    mode = load.io_modes[str(shards[0])]
    assert not mode.startswith("mapped"), mode
    assert all(same(got[k], v) for k, v in reference(shards[:1]).items())


@pytest.mark.parametrize("floats", [10, 3 * 16384 + 25])  # all tail / three blocks and a tail
def test_a_tail_shorter_than_the_alignment_reads_whole(
    tmp_path: Path, floats: int, register_plugin
) -> None:
    path = tmp_path / "tail.safetensors"
    safetensors_torch.save_file({"w": torch.randn(floats), "b": torch.randn(3)}, str(path))
    align = 64 * 1024
    assert 0 < path.stat().st_size % align < align

    class Wide:  # the widest alignment a filesystem reports (see fs.direct_io_alignment)
        @hookimpl(tryfirst=True)
        def loaderplug_io_policy(self, path: str, mode: str) -> IOPolicy:
            return IOPolicy(direct=True, alignment=align, fs_type="ext4", reason="test")

    plugin = Wide()
    register_plugin(plugin)
    load = iter_tensors([path], span_bytes="64K", split_threshold_bytes=0)
    got = dict(load)
    assert load.io_modes[str(path)].startswith("direct")
    assert all(same(got[k], v) for k, v in safetensors_torch.load_file(str(path)).items())
