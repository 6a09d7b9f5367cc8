"""snapshot_download through loaderplug, with the real huggingface_hub client against a
local Hub (tests/hubserver.py) and a folder as the volume mirror."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
import huggingface_hub
from huggingface_hub import _snapshot_download, constants
from loaderplug.integrations import huggingface_hub as lp_hub

from loaderplug import hookimpl
from loaderplug.types import MirrorRequest
from tests.hubserver import HubServer

REPO = "acme/tiny"
FOLDER = "models--acme--tiny"
FILES = {
    "config.json": b'{"model_type": "llama"}\n',
    "model-00001-of-00002.safetensors": os.urandom(300_000),
    "model-00002-of-00002.safetensors": os.urandom(200_000),
    "model.safetensors.index.json": b'{"weight_map": {}}\n',
    "original/consolidated.pth": os.urandom(50_000),
}
original = lp_hub.original_snapshot_download


@pytest.fixture
def volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    vol = tmp_path / "volume"
    vol.mkdir()
    monkeypatch.setenv("LOADERPLUG_VOLUME", str(vol))
    monkeypatch.setenv("LOADERPLUG_FSYNC", "0")
    monkeypatch.setenv("LOADERPLUG_PROGRESS", "0")
    monkeypatch.setenv("LOADERPLUG_HYDRATE_WORKERS", "3")
    return vol


def snapshot_bytes(path: str | Path) -> dict[str, bytes]:
    root = Path(path)
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".cache" not in p.parts
    }


def worker_one(hub: HubServer, tmp_path: Path, **kwargs: object) -> str:
    """The first worker: downloads from the Hub, which fills the mirror."""
    return str(lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache1", **kwargs))


def test_the_first_worker_downloads_and_fills_the_mirror(
    hub: HubServer, tmp_path: Path, volume: Path
) -> None:
    sha = hub.add_repo(REPO, FILES)
    path = worker_one(hub, tmp_path)
    assert path == str((tmp_path / "cache1").resolve() / FOLDER / "snapshots" / sha)
    assert hub.file_requests() > 0
    assert snapshot_bytes(path) == FILES
    mirror = volume / "hub" / FOLDER
    assert (mirror / "refs" / "main").read_text() == sha
    assert (mirror / "trees" / f"{sha}.json").is_file()
    assert snapshot_bytes(mirror / "snapshots" / sha) == FILES
    shard = mirror / "snapshots" / sha / "model-00001-of-00002.safetensors"
    assert os.readlink(shard) == "../../blobs/" + hashlib.sha256(FILES[shard.name]).hexdigest()


def test_the_second_worker_hydrates_with_no_request_and_then_works_offline(
    hub: HubServer, tmp_path: Path, volume: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    hub.reset_counts()
    cache2 = tmp_path / "cache2"
    path = lp_hub.snapshot_download(REPO, cache_dir=cache2)
    assert hub.requests == []
    assert path == str(cache2.resolve() / FOLDER / "snapshots" / sha)
    assert snapshot_bytes(path) == FILES
    # The layout is the Hub client's own: it finds the snapshot offline, by branch too.
    monkeypatch.setenv("LOADERPLUG_VOLUME", str(tmp_path / "gone"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert original(REPO, cache_dir=cache2) == path
    assert original(REPO, cache_dir=cache2, local_files_only=True, revision=sha) == path
    config = huggingface_hub.hf_hub_download(
        REPO, "config.json", cache_dir=cache2, local_files_only=True
    )
    assert Path(config).read_bytes() == FILES["config.json"]
    scanned = huggingface_hub.scan_cache_dir(cache2)
    assert [r.repo_id for r in scanned.repos] == [REPO]
    assert not scanned.warnings
    assert hub.requests == []


def test_patterns_select_what_is_hydrated(hub: HubServer, tmp_path: Path, volume: Path) -> None:
    hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    hub.reset_counts()
    path = lp_hub.snapshot_download(
        REPO,
        cache_dir=tmp_path / "cache2",
        allow_patterns=["*.safetensors", "*.json"],
        ignore_patterns=["*.index.json"],
    )
    assert hub.requests == []
    assert sorted(snapshot_bytes(path)) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_a_mirror_filled_by_a_filtered_download_serves_only_what_it_holds(
    hub: HubServer, tmp_path: Path, volume: Path
) -> None:
    hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path, allow_patterns=["*.json"])
    hub.reset_counts()
    path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2")
    assert snapshot_bytes(path) == FILES
    fetched = {p.rsplit("/", 1)[-1] for m, p in hub.requests if "/resolve/" in p and m == "GET"}
    assert fetched == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                       "consolidated.pth"}  # fmt: skip


def test_revision_by_branch_and_by_commit(hub: HubServer, tmp_path: Path, volume: Path) -> None:
    first = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path, revision=first)
    second = hub.add_repo(REPO, {**FILES, "config.json": b'{"model_type": "mistral"}\n'})
    worker_one(hub, tmp_path)  # main, now the second commit
    hub.reset_counts()
    cache2 = tmp_path / "cache2"
    by_sha = lp_hub.snapshot_download(REPO, cache_dir=cache2, revision=first)
    by_branch = lp_hub.snapshot_download(REPO, cache_dir=cache2, revision="main")
    assert hub.requests == []
    assert by_sha.endswith(first) and by_branch.endswith(second)
    assert Path(by_branch, "config.json").read_bytes() == b'{"model_type": "mistral"}\n'
    assert Path(by_sha, "config.json").read_bytes() == FILES["config.json"]
    assert (cache2 / FOLDER / "refs" / "main").read_text() == second


def test_local_dir_gets_plain_files_from_the_mirror(
    hub: HubServer, tmp_path: Path, volume: Path
) -> None:
    hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    hub.reset_counts()
    target = tmp_path / "plain"
    assert lp_hub.snapshot_download(REPO, local_dir=target) == str(target.resolve())
    assert hub.requests == []
    assert snapshot_bytes(target) == FILES
    assert not any(p.is_symlink() for p in target.rglob("*"))
    # huggingface_hub finds the files current: a later plain call downloads nothing.
    hub.reset_counts()
    original(REPO, local_dir=target)
    assert [m for m, p in hub.requests if "/resolve/" in p and m == "GET"] == []


def test_a_local_dir_download_fills_the_mirror_too(
    hub: HubServer, tmp_path: Path, volume: Path
) -> None:
    sha = hub.add_repo(REPO, FILES)
    lp_hub.snapshot_download(REPO, local_dir=tmp_path / "first")
    assert snapshot_bytes(volume / "hub" / FOLDER / "snapshots" / sha) == FILES
    hub.reset_counts()
    assert snapshot_bytes(lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "c")) == FILES
    assert hub.requests == []


def damage(volume: Path, name: str, how: str) -> None:
    blob = (volume / "hub" / FOLDER / "snapshots").glob(f"*/{name}").__next__().resolve()
    if how == "missing":
        blob.unlink()
    elif how == "short":
        blob.write_bytes(blob.read_bytes()[:-1])
    else:  # same size, other content
        data = bytearray(blob.read_bytes())
        data[1000] ^= 0xFF
        blob.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["missing", "short", "corrupt"])
def test_a_bad_mirror_blob_is_refused_and_downloaded_instead(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    how: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    name = "model-00002-of-00002.safetensors"
    damage(volume, name, how)
    hub.reset_counts()
    with caplog.at_level(logging.WARNING):
        path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2")
    assert snapshot_bytes(path) == FILES
    fetched = [p for m, p in hub.requests if "/resolve/" in p and m == "GET"]
    assert len(fetched) == 1 and fetched[0].endswith(name)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and name in warnings[0], warnings


def test_a_failed_sync_never_fails_the_download(
    hub: HubServer, tmp_path: Path, volume: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hub.add_repo(REPO, FILES)
    (volume / "hub").write_text("a file where the mirror's folder should be")
    with caplog.at_level(logging.WARNING):
        path = worker_one(hub, tmp_path)
    assert snapshot_bytes(path) == FILES
    assert any("the download itself is complete" in r.getMessage() for r in caplog.records)


def test_sync_off_leaves_the_mirror_alone(
    hub: HubServer, tmp_path: Path, volume: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.add_repo(REPO, FILES)
    monkeypatch.setenv("LOADERPLUG_SYNC", "off")
    worker_one(hub, tmp_path)
    assert not (volume / "hub" / FOLDER).exists()


def test_a_plugin_can_point_a_repo_at_another_mirror(
    hub: HubServer, tmp_path: Path, volume: Path, register_plugin
) -> None:
    sha = hub.add_repo(REPO, FILES)
    elsewhere = tmp_path / "team-mirror"
    elsewhere.mkdir()
    seen: list[MirrorRequest] = []

    class TeamMirror:
        @hookimpl
        def loaderplug_find_mirror(self, request: MirrorRequest) -> Path | None:
            seen.append(request)
            return elsewhere if request.name.startswith("acme/") else None

    plugin = TeamMirror()
    register_plugin(plugin)
    worker_one(hub, tmp_path)
    hub.reset_counts()
    path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2")
    assert hub.requests == [] and snapshot_bytes(path) == FILES
    assert (elsewhere / FOLDER / "snapshots" / sha).is_dir()
    assert not (volume / "hub" / FOLDER).exists()
    assert seen[0] == MirrorRequest("hub", REPO, "main")


def test_the_signature_is_the_installed_clients() -> None:
    import inspect

    assert inspect.signature(lp_hub.snapshot_download) == inspect.signature(original)
    with pytest.raises(TypeError, match="no_such_option"):
        lp_hub.snapshot_download(REPO, no_such_option=1)


def test_install_and_uninstall_rebind_every_namespace(
    hub: HubServer, tmp_path: Path, volume: Path
) -> None:
    consumer = types.ModuleType("early_consumer")
    consumer.snapshot_download = huggingface_hub.snapshot_download  # type: ignore[attr-defined]
    sys.modules["early_consumer"] = consumer
    try:
        with lp_hub.installed():
            lp_hub.install()  # idempotent
            assert lp_hub.is_installed()
            for namespace in (huggingface_hub, _snapshot_download, consumer):
                assert namespace.snapshot_download is lp_hub.snapshot_download
            # HfApi.snapshot_download goes through it too: the mirror gets filled.
            sha = hub.add_repo(REPO, FILES)
            huggingface_hub.HfApi().snapshot_download(REPO, cache_dir=tmp_path / "c")
            assert (volume / "hub" / FOLDER / "snapshots" / sha).is_dir()
        assert not lp_hub.is_installed()
        for namespace in (huggingface_hub, _snapshot_download, consumer):
            assert namespace.snapshot_download is original
        assert lp_hub.original_snapshot_download is original
    finally:
        del sys.modules["early_consumer"]


def test_the_example_worker_fills_then_uses_the_mirror(
    hub: HubServer, tmp_path: Path, volume: Path
) -> None:
    import subprocess

    hub.add_repo(REPO, FILES)
    script = Path(__file__).resolve().parent.parent / "examples" / "hf_worker.py"
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint}
    for worker in ("one", "two"):
        env["HF_HUB_CACHE"] = str(tmp_path / f"cache-{worker}")
        done = subprocess.run(
            [sys.executable, str(script), REPO], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert "ready at" in done.stdout
        if worker == "one":
            assert hub.file_requests() > 0
            hub.reset_counts()
    assert hub.requests == []  # the second worker, in a process of its own


def test_transformers_finds_the_hydrated_snapshot_offline(
    hub: HubServer, tmp_path: Path, volume: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transformers = pytest.importorskip("transformers")
    hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    cache2 = tmp_path / "cache2"
    lp_hub.snapshot_download(REPO, cache_dir=cache2)
    hub.reset_counts()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    config = transformers.AutoConfig.from_pretrained(REPO, cache_dir=cache2)
    assert config.model_type == "llama"
    assert hub.requests == []


@pytest.mark.parametrize("bad", [("../../escape.txt", "a" * 40), ("ok.txt", "../../x")])
def test_a_mirror_listing_that_escapes_is_not_trusted(
    hub: HubServer, tmp_path: Path, volume: Path, bad: tuple[str, str]
) -> None:
    import json

    sha = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    listing = volume / "hub" / FOLDER / "trees" / f"{sha}.json"
    data = json.loads(listing.read_text())
    data["files"][bad[0]] = {"size": 1, "blob_id": bad[1]}
    listing.write_text(json.dumps(data))
    path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2")
    assert snapshot_bytes(path) == FILES  # downloaded instead
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "x").exists()
    assert hub.file_requests() > 0


def test_a_cache_on_the_volume_is_left_to_huggingface_hub(
    hub: HubServer, tmp_path: Path, volume: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # HF_HOME on the volume: the cache is the mirror, and there is nothing to copy.
    hub.add_repo(REPO, FILES)
    with caplog.at_level(logging.WARNING):
        path = lp_hub.snapshot_download(REPO, cache_dir=volume / "hub")
        again = lp_hub.snapshot_download(REPO, cache_dir=volume / "hub")
    assert path == again and snapshot_bytes(path) == FILES
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_broken_setting_falls_back_to_the_download(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub.add_repo(REPO, FILES)
    monkeypatch.setenv("LOADERPLUG_HYDRATE_WORKERS", "lots")
    with caplog.at_level(logging.WARNING):
        path = worker_one(hub, tmp_path)
    assert snapshot_bytes(path) == FILES
    assert any("LOADERPLUG_HYDRATE_WORKERS" in r.getMessage() for r in caplog.records)
