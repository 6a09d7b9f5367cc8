"""Which files a load maps, as safetensors does, and which it reads into memory of its
own (LOADERPLUG_OWNED): tensors equal to what safetensors reads either way, a user's
local file mapped, a file that can change under the load owned."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from loaderplug import hookimpl, io_policy
from loaderplug.storage.source import PosixSource
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import VolumeProfile, mounted
from loaderplug.types import IOPolicy
from loaderplug.units import MiB
from tests.conftest import drop_from_page_cache

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
from loaderplug.tensors.reader import iter_tensors  # noqa: E402
from tests.helpers.tensors import mapped_from, reference, same  # noqa: E402


def warm(paths: list[Path]) -> None:
    for p in paths:
        p.read_bytes()


def loaded(paths: list[Path], **settings: Any) -> tuple[dict[str, Any], dict[str, str]]:
    load = iter_tensors(paths, progress=False, **settings)
    got = dict(load)
    return got, load.io_modes


def assert_equal_to_safetensors(got: dict[str, Any], paths: list[Path]) -> None:
    expected = reference(paths)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert same(got[name], tensor), name


@pytest.fixture
def big_model(tmp_path: Path) -> list[Path]:
    """Two shards of 12 MiB: more than one read step each."""
    return sorted(write_model(tmp_path / "big", 24 * MiB, shards=2, tensors_per_shard=6))


@pytest.mark.parametrize("owned", ["auto", "own", "map"])
@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_tensors_equal_safetensors_in_every_mode(
    big_model: list[Path], shards: list[Path], owned: str, cache: str
) -> None:
    paths = [*big_model, *shards]
    for p in paths:
        warm([p]) if cache == "warm" else drop_from_page_cache(p)
    got, _modes = loaded(paths, owned=owned)
    assert_equal_to_safetensors(got, paths)


def test_auto_maps_a_warm_users_file_on_a_local_filesystem(big_model: list[Path]) -> None:
    """As safetensors does: the tensors are views of the file's pages, no copy."""
    warm(big_model)
    got, modes = loaded(big_model)
    assert all(mode.startswith("mapped") for mode in modes.values()), modes
    names = {p.name for p in big_model}
    for name, tensor in got.items():
        assert Path(mapped_from(tensor) or "").name in names, name
    assert_equal_to_safetensors(got, big_model)


def test_auto_maps_a_cold_local_file_the_policy_reads_through_the_page_cache(
    big_model: list[Path],
) -> None:
    """Buffered reads as fast as direct ones on this mount: the file is mapped, and the
    readers ask for its pages ahead of the consumer's touches."""
    from loaderplug.storage.residency import cached_fraction

    for p in big_model:
        drop_from_page_cache(p)
    load = iter_tensors(big_model, progress=False, direct_io="off")
    got = dict(load)  # nothing touched yet
    assert all(m.startswith("mapped") for m in load.io_modes.values()), load.io_modes
    assert all(mapped_from(t) is not None for t in got.values())
    for p in big_model:  # the pages come in without a touch
        waited = 0
        while (cached_fraction(str(p)) or 0.0) < 0.99:
            assert waited < 6000, f"{p.name}'s pages never came into the page cache"
            threading.Event().wait(0.01)
            waited += 1
    assert_equal_to_safetensors(got, big_model)


def test_auto_reads_a_cold_local_file_the_policy_reads_direct_into_memory_of_its_own(
    big_model: list[Path],
) -> None:
    if not io_policy(str(big_model[0]), "on").direct:
        pytest.skip("no direct reads here")
    for p in big_model:
        drop_from_page_cache(p)
    got, modes = loaded(big_model, direct_io="on")
    assert not any(mode.startswith("mapped") for mode in modes.values()), modes
    assert all(mapped_from(t) is None for t in got.values())
    assert_equal_to_safetensors(got, big_model)


def test_owned_on_reads_a_warm_local_file_into_memory_of_its_own(
    big_model: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOADERPLUG_OWNED", "own")
    warm(big_model)
    got, modes = loaded(big_model)
    assert not any(mode.startswith("mapped") for mode in modes.values()), modes
    for name, tensor in got.items():
        assert mapped_from(tensor) is None, name
    assert_equal_to_safetensors(got, big_model)


def test_owned_on_reads_an_own_local_copy_into_memory_of_its_own(big_model: list[Path]) -> None:
    warm(big_model)
    got, modes = loaded(big_model, owned="own", local_copies=str(big_model[0].parent))
    assert not any(mode.startswith("mapped") for mode in modes.values()), modes
    assert all(mapped_from(t) is None for t in got.values())


def test_auto_owns_a_file_of_the_mirror_even_on_a_local_disk(
    big_model: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync may rewrite the mirror under the load."""
    monkeypatch.setenv("LOADERPLUG_MIRROR", str(big_model[0].parent))
    warm(big_model)
    got, modes = loaded(big_model)
    assert not any(mode.startswith("mapped") for mode in modes.values()), modes
    assert all(mapped_from(t) is None for t in got.values())
    assert_equal_to_safetensors(got, big_model)


def on_volume(tmp_path: Path) -> tuple[Path, list[Path]]:
    backing = tmp_path / "backing"
    files = sorted(write_model(backing, 24 * MiB, shards=2, tensors_per_shard=6))
    return backing, files


@pytest.mark.fuse
@pytest.mark.parametrize(("owned", "maps"), [("auto", False), ("own", False), ("map", True)])
def test_a_file_on_a_fuse_volume_is_owned_unless_owned_is_off(
    tmp_path: Path, owned: str, maps: bool
) -> None:
    backing, files = on_volume(tmp_path)
    with mounted(backing, tmp_path / "mnt", VolumeProfile.unthrottled()) as vol:
        paths = [vol.mountpoint / f.name for f in files]
        got, modes = loaded(paths, owned=owned)
        assert all(mode.startswith("mapped") == maps for mode in modes.values()), modes
        assert all((mapped_from(t) is not None) == maps for t in got.values() if t.numel())
        assert_equal_to_safetensors(got, files)
        del got  # no mapping of the volume outlives it


class Readers:
    """Records the threads that open a source for each file and read it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reading: set[str] = set()

    @hookimpl
    def loaderplug_open_source(self, path: str, policy: IOPolicy) -> PosixSource | None:
        readers = self

        class Recorded(PosixSource):
            def pread_into(self, buf: memoryview, offset: int) -> int:
                if len(buf) >= MiB:  # the tensors' bytes, not the header's
                    with readers.lock:
                        readers.reading.add(threading.current_thread().name)
                return super().pread_into(buf, offset)

        return Recorded(path, policy)


def test_owned_warm_files_are_read_by_the_same_few_readers_load_after_load(
    big_model: list[Path], register_plugin: Any
) -> None:
    """No thread is started per load or per file: the process's readers fill every
    file's memory, on descriptors of their own."""
    readers = Readers()
    register_plugin(readers)
    warm(big_model)
    threads_before: set[str] | None = None
    for _ in range(3):
        got, _modes = loaded(big_model, owned="own")
        assert_equal_to_safetensors(got, big_model)
        if threads_before is None:
            threads_before = {t.name for t in threading.enumerate()}
    assert threads_before is not None
    assert {t.name for t in threading.enumerate()} <= threads_before
    assert readers.reading, "no read of a tensor's bytes was seen"
    assert threading.current_thread().name not in readers.reading
    assert 1 <= len(readers.reading) <= 4, readers.reading
