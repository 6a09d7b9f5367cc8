"""The hand-over keeps no tensor it handed over: a tensor the consumer drops is freed at
once, and its memory returned, while the load goes on."""

from __future__ import annotations

import os
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from loaderplug import io_policy, iter_tensors
from loaderplug.units import MiB
from tests.helpers.tensors import file_mappings

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

TENSOR_BYTES = 8 * MiB
SHARDS, PER_SHARD = 3, 4


@pytest.fixture
def model(tmp_path: Path) -> list[Path]:
    paths = []
    for shard in range(SHARDS):
        tensors = {
            f"s{shard}.w{i}": torch.full((TENSOR_BYTES // 4,), float(shard * 10 + i))
            for i in range(PER_SHARD)
        }
        path = tmp_path / "mirror" / f"model-{shard}.safetensors"
        path.parent.mkdir(exist_ok=True)
        safetensors_torch.save_file(tensors, str(path))
        paths.append(path)
    return paths


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def released(ref: weakref.ref[Any]) -> bool:
    """Whether ``ref``'s tensor dies: at once, or as soon as the engine's thread that
    handed it over returns from the call that did (its frame holds the tensor until
    then; the consumer may run first), waited for a second at most."""
    for _ in range(1000):
        if ref() is None:
            return True
        time.sleep(0.001)
    return ref() is None


def drop_each(load: object) -> tuple[int, int]:
    """Take every tensor, check its value, drop it and see it freed before asking for the
    next; the number taken, and the most resident memory grew meanwhile."""
    base, grown, taken = resident_bytes(), 0, 0
    for name, tensor in load:  # type: ignore[attr-defined]
        shard, index = name[1:].split(".w")
        assert float(tensor[0]) == float(int(shard) * 10 + int(index))
        freed = weakref.ref(tensor)
        del tensor
        assert released(freed), f"{name} is still referenced after the consumer dropped it"
        grown = max(grown, resident_bytes() - base)
        taken += 1
    return taken, grown


def test_a_one_pass_frees_each_dropped_tensor_at_once(model: list[Path], tmp_path: Path) -> None:
    load = iter_tensors(model, local_dir=tmp_path / "local", bytes_in_flight="16M", progress=False)
    taken, grown = drop_each(load)
    assert taken == SHARDS * PER_SHARD
    # Each dropped tensor's pages went back: the load holds a window, never the model.
    assert grown < SHARDS * PER_SHARD * TENSOR_BYTES // 2, grown
    assert load.report is not None and load.report.ok


def test_mapped_files_free_each_dropped_tensor_at_once(model: list[Path]) -> None:
    for path in model:
        path.read_bytes()  # in the page cache, and own local copies: mapped
    own = str(model[0].parent)
    load = iter_tensors(model, direct_io="off", progress=False, local_copies=own)
    taken, _ = drop_each(load)
    assert taken == SHARDS * PER_SHARD
    assert all(mode.startswith("mapped") for mode in load.io_modes.values()), load.io_modes


def test_owned_files_read_without_the_engine_free_each_dropped_tensor_at_once(
    model: list[Path],
) -> None:
    for path in model:
        path.read_bytes()  # in the page cache, owned: read by the process's readers
    load = iter_tensors(model, owned="own", bytes_in_flight="16M", progress=False)
    taken, grown = drop_each(load)
    assert taken == SHARDS * PER_SHARD
    assert grown < SHARDS * PER_SHARD * TENSOR_BYTES // 2, grown
    assert all(m.startswith("read by the process's readers") for m in load.io_modes.values())


def test_tensors_read_in_place_free_each_dropped_tensor_at_once(model: list[Path]) -> None:
    if not io_policy(str(model[0]), "on").direct:
        pytest.skip("no direct reads here")
    load = iter_tensors(model, direct_io="on", bytes_in_flight="16M", progress=False)
    taken, grown = drop_each(load)
    assert taken == SHARDS * PER_SHARD
    assert grown < SHARDS * PER_SHARD * TENSOR_BYTES // 2, grown
    assert not any(mode.startswith("mapped") for mode in load.io_modes.values())


@pytest.mark.parametrize("one_pass", [False, True])
def test_through_the_page_cache_each_tensor_is_a_mapping_of_the_file(
    model: list[Path], tmp_path: Path, one_pass: bool
) -> None:
    """What ranks sharing a host's page cache do: each file read (buffered, counted as
    read), and each tensor a view of the file's own pages, not a copy of them (in a one
    pass, of the copy being written, which is then published under its name); the
    tensors kept outside the memory budget, so a consumer holding all of them never
    waits for it."""
    from loaderplug.jobs.runner import Runner
    from loaderplug.settings import from_env
    from loaderplug.tensors.delivery.hand_over import TensorsOf
    from loaderplug.tensors.delivery.plan import load_plan
    from loaderplug.tensors.device.path import DevicePath

    for path in model:  # cold, so the bytes come through the engine's reads
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    local = tmp_path / "local" if one_pass else None
    # Read in place, the files are own local copies: only those are ever mapped.
    own = str(tmp_path / "copies" if one_pass else model[0].parent)
    settings = from_env(direct_io="off", bytes_in_flight="16M", progress=False, local_copies=own)
    plan = load_plan(
        model,
        DevicePath("cpu", None),
        settings,
        local,
        through_page_cache=True,
        shared_by_ranks=True,
    )
    runner = Runner(plan, settings)
    held = dict(TensorsOf(runner.run()))  # the budget (16 MiB) is less than the model
    maps = file_mappings()
    assert len(held) == SHARDS * PER_SHARD
    for name, tensor in held.items():
        shard = model[int(name[1:].split(".w")[0])]
        mapped = local / shard.name if local is not None else shard
        address = tensor.data_ptr()
        inside = [path for start, end, path in maps if start <= address < end]
        assert inside == [str(mapped)], f"{name} is not a view of {mapped}: {inside}"
        assert torch.equal(tensor, safetensors_torch.load_file(str(shard))[name])
    assert runner.report.bytes_copied == sum(p.stat().st_size for p in model)
    status = "restored" if one_pass else "loaded"
    assert {r.status for r in runner.report.results} == {status}
    if local is not None:
        assert all((local / p.name).read_bytes() == p.read_bytes() for p in model)
