"""snapshot_download through loaderplug, with the real huggingface_hub client against a
local Hub (loaderplug/testing/hub.py) and a folder as the volume mirror."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import sys
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("huggingface_hub")
import huggingface_hub
from huggingface_hub import _snapshot_download, constants
from huggingface_hub.errors import LocalEntryNotFoundError

from loaderplug import hookimpl
from loaderplug.integrations import huggingface_hub as lp_hub
from loaderplug.testing.hub import HubServer
from loaderplug.types import MirrorRequest

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


def snapshot_bytes(path: str | Path) -> dict[str, bytes]:
    root = Path(path)
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".cache" not in p.parts
    }


def listing_of(*commits: str) -> list[tuple[str, str]]:
    """The requests a worker makes of an answering Hub to serve these commits from the
    mirror: one listing of each, the Hub's word on what it holds."""
    return [("GET", f"/api/models/{REPO}/tree/{c}?recursive=true&expand=false") for c in commits]


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
    assert hub.requests == listing_of(sha)  # no file: the commit's listing alone
    assert path == str(cache2.resolve() / FOLDER / "snapshots" / sha)
    assert snapshot_bytes(path) == FILES
    hub.reset_counts()
    # The layout is the Hub client's own: it finds the snapshot offline, by branch too.
    monkeypatch.setenv("LOADERPLUG_MIRROR", str(tmp_path / "gone"))
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
    sha = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    hub.reset_counts()
    path = lp_hub.snapshot_download(
        REPO,
        cache_dir=tmp_path / "cache2",
        allow_patterns=["*.safetensors", "*.json"],
        ignore_patterns=["*.index.json"],
    )
    assert hub.requests == listing_of(sha)
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
    assert hub.requests == listing_of(first, second)  # main's commit is this process's pin
    assert by_sha.endswith(first) and by_branch.endswith(second)
    assert Path(by_branch, "config.json").read_bytes() == b'{"model_type": "mistral"}\n'
    assert Path(by_sha, "config.json").read_bytes() == FILES["config.json"]
    assert (cache2 / FOLDER / "refs" / "main").read_text() == second


def test_local_dir_gets_plain_files_from_the_mirror(
    hub: HubServer, tmp_path: Path, volume: Path
) -> None:
    sha = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    hub.reset_counts()
    target = tmp_path / "plain"
    assert lp_hub.snapshot_download(REPO, local_dir=target) == str(target.resolve())
    assert hub.requests == listing_of(sha)
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
    assert hub.requests == listing_of(sha)


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
    caplog.clear()  # the first worker's (the mirror held nothing yet)
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
    assert hub.requests == listing_of(sha) and snapshot_bytes(path) == FILES
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


@pytest.mark.slow("example worker processes that import transformers")
def test_the_example_worker_fills_then_uses_the_mirror(
    hub: HubServer, tmp_path: Path, volume: Path
) -> None:
    import subprocess

    sha = hub.add_repo(REPO, FILES)
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
    # The second worker, in a process of its own: one request learns the commit of main
    # (as stock huggingface_hub asks), one lists that commit, and no file comes from the Hub.
    assert hub.requests == [("GET", f"/api/models/{REPO}/revision/main"), *listing_of(sha)]


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
    monkeypatch.setenv("LOADERPLUG_READERS", "lots")
    with caplog.at_level(logging.WARNING):
        path = worker_one(hub, tmp_path)
    assert snapshot_bytes(path) == FILES
    assert any("LOADERPLUG_READERS" in r.getMessage() for r in caplog.records)


# -- mirrors written before huggingface_hub kept listings, and Hub outages -------------


def make_legacy(volume: Path) -> bytes:
    """Make the filled mirror one written before huggingface_hub 1.22: no trees/. Return
    the listing huggingface_hub had written, byte for byte."""
    trees = volume / "hub" / FOLDER / "trees"
    (listing,) = trees.iterdir()
    data = listing.read_bytes()
    shutil.rmtree(trees)
    return data


def tree_requests(hub: HubServer) -> list[str]:
    return [p for m, p in hub.requests if "/tree/" in p]


def loaderplug_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name.startswith("loaderplug")
    ]


def test_a_legacy_mirror_gets_its_listing_with_one_request_and_keeps_it(
    hub: HubServer, tmp_path: Path, volume: Path
) -> None:
    sha = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    written = make_legacy(volume)
    mirror = volume / "hub" / FOLDER
    hub.reset_counts()
    cache2 = tmp_path / "cache2"
    path = lp_hub.snapshot_download(REPO, cache_dir=cache2)
    # One request, the listing of the commit the mirror's ref names; no file from the Hub.
    assert hub.requests == [("GET", f"/api/models/{REPO}/tree/{sha}?recursive=true&expand=false")]
    assert path == str(cache2.resolve() / FOLDER / "snapshots" / sha)
    assert snapshot_bytes(path) == FILES
    # The listing is on the mirror, byte for byte what huggingface_hub itself wrote, and in
    # the local cache; huggingface_hub reads both, and checks the snapshot offline by it.
    assert (mirror / "trees" / f"{sha}.json").read_bytes() == written
    assert (cache2.resolve() / FOLDER / "trees" / f"{sha}.json").read_bytes() == written
    cached = huggingface_hub.get_cached_repo_tree(REPO, cache_dir=volume / "hub")
    assert sorted(f.path for f in cached) == sorted(FILES)
    assert original(REPO, cache_dir=cache2, local_files_only=True) == path
    # The next worker needs no request at all.
    hub.reset_counts()
    again = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache3")
    assert hub.requests == []
    assert snapshot_bytes(again) == FILES


def test_a_legacy_mirror_missing_a_blob_downloads_it(
    hub: HubServer, tmp_path: Path, volume: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sha = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    written = make_legacy(volume)
    name = "model-00002-of-00002.safetensors"
    damage(volume, name, "missing")
    hub.reset_counts()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2")
    assert snapshot_bytes(path) == FILES
    assert len(tree_requests(hub)) == 1  # loaderplug's; the original reads the listing
    fetched = [p for m, p in hub.requests if "/resolve/" in p and m == "GET"]
    assert len(fetched) == 1 and fetched[0].endswith(name)
    (warning,) = loaderplug_warnings(caplog)
    assert name in warning and "blob is not on the mirror" in warning
    mirror = volume / "hub" / FOLDER
    assert (mirror / "trees" / f"{sha}.json").read_bytes() == written
    assert snapshot_bytes(mirror / "snapshots" / sha) == FILES  # the download filled it


def test_a_listing_the_mirror_cannot_keep_goes_to_the_local_cache(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from loaderplug.integrations.hub import mirror as hub_mirror

    sha = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    written = make_legacy(volume)
    write_listing = hub_mirror.write_listing

    def read_only_mirror(folder: Path, *args: Any, **kwargs: Any) -> bool:
        if volume in folder.parents:
            raise PermissionError(13, "Read-only file system", str(folder))
        return write_listing(folder, *args, **kwargs)

    monkeypatch.setattr(hub_mirror, "write_listing", read_only_mirror)
    hub.reset_counts()
    caplog.clear()
    cache2 = tmp_path / "cache2"
    with caplog.at_level(logging.WARNING):
        path = lp_hub.snapshot_download(REPO, cache_dir=cache2)
    assert len(hub.requests) == 1 and hub.file_requests() == 0
    assert snapshot_bytes(path) == FILES
    assert not (volume / "hub" / FOLDER / "trees").exists()
    assert (cache2.resolve() / FOLDER / "trees" / f"{sha}.json").read_bytes() == written
    (warning,) = loaderplug_warnings(caplog)
    assert "could not be kept on the mirror" in warning and "Read-only" in warning


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def hub_out_of_reach(how: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Make the Hub unreachable (``down``: nothing listens where it was) or forbidden
    (``offline``: HF_HUB_OFFLINE=1; ``local_files_only``); the call's extra options."""
    if how == "down":
        endpoint = closed_port()
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(
            constants,
            "HUGGINGFACE_CO_URL_TEMPLATE",
            endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        )
        # huggingface_hub retries a refused connection 5 times over some 23 s: once will do.
        from huggingface_hub.utils import http_backoff

        monkeypatch.setitem(http_backoff.__kwdefaults__, "max_retries", 0)
        return {}
    if how == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        return {}
    return {"local_files_only": True}


@pytest.mark.parametrize("how", ["down", "offline", "local_files_only"])
@pytest.mark.parametrize("by", ["branch", "commit"])
def test_a_legacy_mirror_serves_its_snapshot_when_the_hub_cannot_be_asked(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
    by: str,
) -> None:
    sha = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    make_legacy(volume)
    hub.reset_counts()
    options = hub_out_of_reach(how, monkeypatch)
    if by == "commit":
        options["revision"] = sha
    listings: list[str] = []  # the commits loaderplug asked the Hub to list
    list_repo_tree = huggingface_hub.HfApi.list_repo_tree

    def counted(api: huggingface_hub.HfApi, *args: Any, **kwargs: Any) -> Any:
        listings.append(kwargs["revision"])
        return list_repo_tree(api, *args, **kwargs)

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", counted)
    cache2 = tmp_path / "cache2"
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        path = lp_hub.snapshot_download(REPO, cache_dir=cache2, **options)
    assert hub.requests == []
    assert path == str(cache2.resolve() / FOLDER / "snapshots" / sha)
    assert snapshot_bytes(path) == FILES
    warnings = loaderplug_warnings(caplog)
    if by == "branch" and how == "down":  # which commit main names: the mirror's, said once
        pin = warnings.pop(0)
        assert f"using the mirror's, {sha}" in pin and "could not be reached" in pin, pin
    (warning,) = warnings
    assert "completeness was not checked" in warning and "no file listing" in warning
    assert {"down": "could not be reached", "offline": "HF_HUB_OFFLINE"}.get(how, how) in warning
    assert not (volume / "hub" / FOLDER / "trees").exists()  # nothing to keep
    # As huggingface_hub serves its own cache offline: by the ref, without a listing.
    if by == "branch":
        assert (cache2 / FOLDER / "refs" / "main").read_text() == sha
    assert original(REPO, cache_dir=cache2, local_files_only=True, revision=sha) == path
    shard = Path(path, "model-00001-of-00002.safetensors")
    assert os.readlink(shard) == "../../blobs/" + hashlib.sha256(FILES[shard.name]).hexdigest()
    # A Hub out of reach is asked once (for the commit of a branch, else for the
    # listing), and not again at once: each try costs its retries.
    asked = 1 if how == "down" and by == "commit" else 0
    assert listings.count(sha) == asked
    again = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache3", **options)
    assert snapshot_bytes(again) == FILES
    assert listings.count(sha) == asked


def test_an_unchecked_snapshot_keeps_to_the_patterns_and_refuses_a_bad_blob(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    make_legacy(volume)
    bad = "model-00002-of-00002.safetensors"
    damage(volume, bad, "corrupt")  # same size: only its hash tells
    hub_out_of_reach("offline", monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        path = lp_hub.snapshot_download(
            REPO, cache_dir=tmp_path / "cache2", ignore_patterns=["original/*"]
        )
    expected = {p: b for p, b in FILES.items() if p != bad and not p.startswith("original/")}
    assert snapshot_bytes(path) == expected
    (warning,) = loaderplug_warnings(caplog)
    assert "completeness was not checked" in warning
    assert f"left out 1 file(s) ({bad}: " in warning


def test_a_legacy_mirror_fills_a_local_dir_offline(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    make_legacy(volume)
    with monkeypatch.context() as offline:
        hub_out_of_reach("offline", offline)
        target = tmp_path / "plain"
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert lp_hub.snapshot_download(REPO, local_dir=target) == str(target.resolve())
    assert snapshot_bytes(target) == FILES
    assert not any(p.is_symlink() for p in target.rglob("*"))
    (warning,) = loaderplug_warnings(caplog)
    assert "completeness was not checked" in warning
    # Back online, huggingface_hub finds the files current: it downloads none of them.
    hub.reset_counts()
    original(REPO, local_dir=target)
    assert [m for m, p in hub.requests if "/resolve/" in p and m == "GET"] == []


def test_a_mirror_without_the_snapshot_leaves_an_offline_call_to_huggingface_hub(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sha = hub.add_repo(REPO, FILES)
    worker_one(hub, tmp_path)
    make_legacy(volume)
    shutil.rmtree(volume / "hub" / FOLDER / "snapshots" / sha)
    hub_out_of_reach("offline", monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(LocalEntryNotFoundError):
        lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2")
    (warning,) = loaderplug_warnings(caplog)
    assert f"holds no snapshot of commit {sha}" in warning
    assert "huggingface_hub's own cache answers" in warning


def _unknown_format(volume: Path, sha: str) -> None:
    listing = volume / "hub" / FOLDER / "trees" / f"{sha}.json"
    data = json.loads(listing.read_text())
    listing.write_text(json.dumps({**data, "format_version": 2}))


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("empty", "holds no models--acme--tiny"),
        ("other branch", "holds no ref 'dev' (refs/dev)"),
        ("unknown listing format", "is of format 2, not 1"),
        ("force_download", "force_download asks the Hub itself"),
    ],
)
def test_a_skipped_mirror_says_why_at_warning(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    caplog: pytest.LogCaptureFixture,
    case: str,
    reason: str,
) -> None:
    sha = hub.add_repo(REPO, FILES)
    options: dict[str, object] = {}
    if case != "empty":
        worker_one(hub, tmp_path)
    if case == "other branch":
        hub.add_repo(REPO, FILES, branch="dev")
        options["revision"] = "dev"
    if case == "unknown listing format":
        _unknown_format(volume, sha)
    if case == "force_download":
        options["force_download"] = True
    hub.reset_counts()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2", **options)
    assert snapshot_bytes(path) == FILES
    assert hub.file_requests() > 0  # downloaded
    (warning,) = loaderplug_warnings(caplog)
    assert "not using the mirror" in warning and reason in warning, warning
