"""volcache's core, without vLLM: which weights, from where, hydrated once, shared by ranks."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from loaderplug.errors import SettingsError
from loaderplug.integrations import volcache
from loaderplug.settings import from_env
from loaderplug.testing.hub import HubServer
from loaderplug.testing.volume import TestVolume, VolumeProfile, mounted
from loaderplug.units import MiB
from tests.helpers.tensors import reference, same, write_shards

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
REPO = Path(__file__).resolve().parent.parent
QUIET = {"fsync": False, "progress": False}


def with_index(folder: Path, shards: list[Path]) -> None:
    weight_map = {
        name: p.name for p in shards for name in json.loads(_header(p)) if name != "__metadata__"
    }
    (folder / volcache.INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return f.read(n)


def test_weights_are_the_indexed_safetensors_at_the_top_level(tmp_path: Path) -> None:
    shards = write_shards(tmp_path)
    with_index(tmp_path, shards[:2])  # the third shard is not in the index
    (tmp_path / "original").mkdir()
    (tmp_path / "original" / "consolidated.safetensors").hardlink_to(shards[0])
    assert volcache.weight_files(tmp_path) == shards[:2]


def test_a_weight_file_named_by_the_index_but_missing_is_a_clear_error(tmp_path: Path) -> None:
    shards = write_shards(tmp_path)
    with_index(tmp_path, shards)
    shards[1].unlink()
    with pytest.raises(volcache.WeightsError, match=r"missing: model-1\.safetensors"):
        volcache.weight_files(tmp_path)


def test_a_folder_without_weights_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(volcache.WeightsError, match=r"no \*\.safetensors weights"):
        volcache.locate_weights(str(tmp_path), None, from_env())


def test_a_local_folder_is_read_in_place(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shards = write_shards(tmp_path)
    weights = volcache.locate_weights(
        str(tmp_path), None, from_env(local_copies=str(tmp_path / "copies"))
    )
    assert weights.local_copy is None and weights.files == shards
    with caplog.at_level(logging.INFO, logger=volcache.__name__):
        got = dict(volcache.stream(weights, from_env(**QUIET)))
    assert all(same(got[k], v) for k, v in reference(shards).items())
    # Once done, the load says what it did: vLLM's log shows it after its own line.
    (said,) = [r.getMessage() for r in caplog.records if "first tensor at" in r.getMessage()]
    # A user's warm folder on a local filesystem is mapped, as safetensors maps it.
    assert said.startswith("loaderplug: 3 file(s); ") and "MiB mapped" in said
    assert "MiB read in" not in said


def test_a_folder_under_the_volume_is_hydrated_once_then_read_locally(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    model = volume / "models" / "tiny"
    model.mkdir(parents=True)
    shards = write_shards(model)
    settings = from_env(mirror=str(volume), local_copies=str(tmp_path / "copies"), **QUIET)
    weights = volcache.locate_weights(str(model), None, settings)
    assert weights.local_copy is not None and weights.local_copy.parent == tmp_path / "copies"
    got = dict(volcache.stream(weights, settings))
    assert all(same(got[k], v) for k, v in reference(shards).items())
    for shard in shards:
        assert (weights.local_copy / shard.name).read_bytes() == shard.read_bytes()
    # A later start finds the copy current: the mirror is not read again.
    for shard in shards:
        shard.chmod(0)
    try:
        again = dict(volcache.stream(weights, settings))
    finally:
        for shard in shards:
            shard.chmod(0o644)
    assert all(same(again[k], v) for k, v in got.items())


def test_a_repo_id_is_found_in_the_mirrors_hub_layout(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    commit = "a" * 40
    repo = volume / "hub" / "models--acme--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    shards = write_shards(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    settings = from_env(mirror=str(volume), local_copies=str(tmp_path / "copies"), **QUIET)
    weights = volcache.locate_weights("acme/tiny", None, settings)
    assert weights.folder == snapshot and weights.files == shards
    assert weights.local_copy is not None and weights.local_copy.name.startswith("acme--tiny-")


def test_an_unknown_model_names_every_place_it_looked(
    tmp_path: Path, hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = from_env(mirror=str(tmp_path))
    with pytest.raises(volcache.WeightsError, match="not on the mirror") as failed:
        volcache.locate_weights("acme/absent", None, settings)
    assert "not in the local Hugging Face cache" in str(failed.value)
    assert "the Hub download failed: RepositoryNotFoundError" in str(failed.value)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(volcache.WeightsError, match=r"the Hub is offline \(HF_HUB_OFFLINE\)"):
        volcache.locate_weights("acme/absent", None, settings)


def test_bad_settings_fail_before_any_read() -> None:
    with pytest.raises(SettingsError):
        from_env(readers="many")


@pytest.fixture
def fuse_mirror(tmp_path: Path) -> Iterator[tuple[TestVolume, list[Path]]]:
    backing = tmp_path / "backing"
    backing.mkdir()
    shards = write_shards(backing, count=4)
    profile = VolumeProfile(per_stream_bytes_per_s=8 * MiB)
    with mounted(backing, tmp_path / "mnt", profile) as vol:
        yield vol, shards


@pytest.mark.fuse
def test_a_folder_on_a_fuse_mount_is_a_mirror(
    fuse_mirror: tuple[TestVolume, list[Path]], tmp_path: Path
) -> None:
    vol, _shards = fuse_mirror
    weights = volcache.locate_weights(
        str(vol.mountpoint), None, from_env(local_copies=str(tmp_path / "c"))
    )
    assert weights.local_copy is not None


RANK = """
import json, sys, zlib
from loaderplug.integrations import volcache
from loaderplug.settings import from_env
settings = from_env(fsync=False, progress=False)
weights = volcache.locate_weights(sys.argv[1], None, settings)
sums = {n: zlib.crc32(t.numpy().tobytes()) for n, t in volcache.stream(weights, settings)}
print(json.dumps(sums))
"""


@pytest.mark.slow("ranks of a gloo group in processes of their own")
@pytest.mark.fuse
def test_ranks_loading_at_once_read_the_mirror_once(
    fuse_mirror: tuple[TestVolume, list[Path]], tmp_path: Path
) -> None:
    vol, shards = fuse_mirror
    vol.reset_stats()
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "LOADERPLUG_LOCAL_COPIES": str(tmp_path / "copies"),
        "LOADERPLUG_IO_PROBE": "0",  # as in every test (see conftest)
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(vol.mountpoint)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = []
    for rank in ranks:
        out, err = rank.communicate(timeout=120)
        assert rank.returncode == 0, err
        outputs.append(json.loads(out))
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(outputs[0]) == len(reference(shards))
    model_bytes = sum(p.stat().st_size for p in shards)
    # One rank copied; the others waited on the lock and read the local copy. Headers
    # are read by every rank before it waits, hence the small allowance.
    read = vol.stats()["bytes_read"]
    assert model_bytes <= read < model_bytes + 3 * 4 * 64 * 1024, read


def test_vllms_plugin_never_fails_a_start_over_its_mirror_hooks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import logging

    from loaderplug.integrations import vllm as lp_vllm

    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    # vLLM, once imported, keeps its logger's records from the root (and from caplog).
    collect = Collect()
    lp_vllm.log.addHandler(collect)
    monkeypatch.setenv("LOADERPLUG_MIRROR", str(tmp_path))
    monkeypatch.setenv("LOADERPLUG_SPAN_BYTES", "huge")
    try:
        lp_vllm._install_mirror_hooks()
    finally:
        lp_vllm.log.removeHandler(collect)
    assert any("mirror hooks not installed" in m for m in collect.messages)


def test_renamed_extra_config_keys_still_work_for_a_release() -> None:
    from loaderplug.integrations.vllm import settings_from_extra_config

    old = {"workers": 4, "chunk_bytes": "8M", "local_dir": "/local/x", "mirror": "/mnt/m"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        settings = settings_from_extra_config(old)
    said = sorted(str(w.message).split(" is now ")[0] for w in caught)
    assert all(w.category is DeprecationWarning for w in caught)
    assert said == [f"--model-loader-extra-config key {k!r}" for k in sorted(old) if k != "mirror"]
    assert (settings.readers, settings.span_bytes) == (4, 8 * MiB)
    assert (settings.local_copies, settings.mirror) == ("/local/x", "/mnt/m")
