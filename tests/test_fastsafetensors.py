"""fastsafetensors through loaderplug, on the CPU (``device="cpu", nogds=True``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastsafetensors")
pytest.importorskip("torch")
from fastsafetensors.copier import registry

from loaderplug.integrations import fastsafetensors as lp_fst
from loaderplug.testing.volume import (
    TestVolume,
    VolumeProfile,
    mounted,
)
from loaderplug.units import MiB
from tests.conftest import drop_from_page_cache
from tests.helpers.tensors import reference, same, write_shards


@pytest.fixture
def installed() -> Iterator[None]:
    lp_fst.install()
    try:
        yield
    finally:
        lp_fst.uninstall()


@pytest.fixture
def fuse_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestVolume]:
    backing = tmp_path / "backing"
    backing.mkdir()
    write_shards(backing, count=3)
    monkeypatch.setenv("LOADERPLUG_LOCAL_COPIES", str(tmp_path / "copies"))
    monkeypatch.setenv("LOADERPLUG_PROGRESS", "0")
    monkeypatch.setenv("LOADERPLUG_FSYNC", "0")
    with mounted(backing, tmp_path / "mnt", VolumeProfile(per_stream_bytes_per_s=32 * MiB)) as v:
        yield v


def load_with(files: list[str], how: str) -> dict[str, object]:
    if how == "fastsafe_open":
        with lp_fst.fastsafe_open(files, device="cpu", nogds=True) as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    if how == "SafeTensorsFileLoader":
        loader = lp_fst.SafeTensorsFileLoader(None, "cpu", nogds=True)
        try:
            loader.add_filenames({0: files})
            buffers = loader.copy_files_to_device()
            return {k: buffers.get_tensor(k) for k in loader.get_keys()}
        finally:
            loader.close()
    loader = lp_fst.ParallelLoader(None, files, device="cpu", nogds=True, use_tqdm_on_load=False)
    return dict(loader.iterate_weights())


@pytest.mark.fuse
@pytest.mark.parametrize("how", ["fastsafe_open", "SafeTensorsFileLoader", "ParallelLoader"])
def test_mirror_files_are_hydrated_first_and_tensors_equal_safetensors(
    fuse_mirror: TestVolume, tmp_path: Path, how: str, installed: None
) -> None:
    files = sorted(str(p) for p in fuse_mirror.mountpoint.glob("*.safetensors"))
    expected = reference(sorted((tmp_path / "backing").glob("*.safetensors")))
    got = load_with(files, how)
    assert sorted(got) == sorted(expected)
    assert all(same(got[k], v) for k, v in expected.items())
    (copy,) = (tmp_path / "copies").iterdir()
    for name in ("model-0.safetensors", "model-1.safetensors", "model-2.safetensors"):
        assert (copy / name).read_bytes() == (tmp_path / "backing" / name).read_bytes()


@pytest.mark.fuse
def test_fastsafetensors_is_told_loaderplugs_direct_or_buffered_choice(
    fuse_mirror: TestVolume, tmp_path: Path, installed: None, caplog: pytest.LogCaptureFixture
) -> None:
    from fastsafetensors import fastsafe_open  # fastsafetensors' own entry point

    local = sorted(str(p) for p in (tmp_path / "backing").glob("*.safetensors"))[:1]
    drop_from_page_cache(local[0])  # a cached file would be read buffered, from memory
    on_fuse = sorted(str(p) for p in fuse_mirror.mountpoint.glob("*.safetensors"))[:1]
    with caplog.at_level(logging.DEBUG, logger="loaderplug"):
        for files in (local, on_fuse):
            with fastsafe_open(files, device="cpu", nogds=True) as f:
                assert f.keys()
    said = [r.getMessage() for r in caplog.records if "fastsafetensors reads" in r.getMessage()]
    assert said[0].startswith(f"fastsafetensors reads {local[0]} direct")
    assert said[1].startswith(f"fastsafetensors reads {on_fuse[0]} buffered")
    assert "fuse" in said[1]


def test_install_and_uninstall_swap_the_registered_copier() -> None:
    original = registry._copier_registry["nogds"]
    lp_fst.install()
    lp_fst.install()  # idempotent
    try:
        assert registry._copier_registry["nogds"] is not original
    finally:
        lp_fst.uninstall()
    assert registry._copier_registry["nogds"] is original


def test_a_local_file_is_read_in_place(tmp_path: Path) -> None:
    files = [str(p) for p in write_shards(tmp_path)]
    assert lp_fst.local_files(files) == files


def test_too_old_a_fastsafetensors_is_refused() -> None:
    from loaderplug.errors import LoaderplugError

    with pytest.raises(LoaderplugError, match=r"0\.4\.9 is too old.*pip install -U"):
        lp_fst._check_version("0.4.9")


@pytest.mark.slow("starts vLLM")
@pytest.mark.fuse
def test_vllms_fastsafetensors_load_format_hydrates_first(
    fuse_mirror: TestVolume, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader import default_loader, weight_utils

    seen: list[list[str]] = []

    def fastsafetensors_weights_iterator(files: list[str], use_tqdm: bool) -> Iterator[object]:
        seen.append(files)
        return iter(())

    # vLLM's own iterator needs CUDA; a stand-in records what it is handed.
    monkeypatch.setattr(
        weight_utils, "fastsafetensors_weights_iterator", fastsafetensors_weights_iterator
    )
    monkeypatch.setattr(
        default_loader, "fastsafetensors_weights_iterator", fastsafetensors_weights_iterator
    )
    lp_fst.hydrate_before_vllm_load()
    lp_fst.hydrate_before_vllm_load()  # idempotent
    files = sorted(str(p) for p in fuse_mirror.mountpoint.glob("*.safetensors"))
    list(default_loader.fastsafetensors_weights_iterator(files, False))
    (handed,) = seen
    (copy,) = (tmp_path / "copies").iterdir()
    assert handed == [str(copy / Path(f).name) for f in files]


@pytest.mark.slow("runs the example script in a process of its own")
@pytest.mark.fuse
def test_the_example_script_reads_a_mirror_through_loaderplug(
    fuse_mirror: TestVolume, tmp_path: Path
) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "examples" / "fastsafetensors_user.py"
    files = sorted(str(p) for p in fuse_mirror.mountpoint.glob("*.safetensors"))
    done = subprocess.run(
        [sys.executable, str(script), *files], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("21 tensors")
    (copy,) = (tmp_path / "copies").iterdir()
    assert len(list(copy.glob("*.safetensors"))) == 3
