"""The local Hub server is faithful enough for the real ``huggingface_hub`` client."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
import huggingface_hub.constants
from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    IncompleteSnapshotError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from loaderplug.testing.hub import HubServer, git_blob_sha1
from tests.hubserver import hub as hub  # the fixture (`as hub`: no ruff F401/F811)

REPO = "org/name"
SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
INDEX = {"metadata": {}, "weight_map": {"a": SHARD1, "b": SHARD2}}
FILES = {
    "config.json": b'{"model_type": "llama"}\n',
    SHARD1: b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(256)) * 40,
    SHARD2: b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " + bytes(range(255, -1, -1)) * 30,
    "model.safetensors.index.json": json.dumps(INDEX).encode(),
    "original/consolidated.pth": b"PK\x03\x04" + b"\x01" * 3000,
}
LFS = {SHARD1, SHARD2}  # *.safetensors; *.pth is not in the default lfs_patterns


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under root (following symlinks), by '/'-separated relative path."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".cache" not in p.relative_to(root).parts
    }


def resolved(hub: HubServer) -> list[str]:
    """The file names of every /resolve/ request, in order."""
    return [
        path.split("/resolve/", 1)[1].split("/", 1)[1]
        for _, path in hub.requests
        if "/resolve/" in path
    ]


def test_snapshot_download_builds_the_genuine_cache(hub: HubServer, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, FILES)
    cache = tmp_path / "cache"

    path = Path(snapshot_download(REPO, cache_dir=cache))

    storage = cache / "models--org--name"
    assert path == storage / "snapshots" / sha
    assert files_under(path) == FILES
    assert (storage / "refs" / "main").read_text() == sha
    for name, data in FILES.items():
        link = path / name
        assert link.is_symlink()
        target = os.readlink(link)
        assert not os.path.isabs(target) and target.startswith("../")
        blob = link.resolve()
        assert blob.parent == (storage / "blobs").resolve()
        expected = hashlib.sha256(data).hexdigest() if name in LFS else git_blob_sha1(data)
        assert blob.name == expected
    assert sorted(p.name for p in (storage / "blobs").iterdir()) == sorted(
        hashlib.sha256(d).hexdigest() if n in LFS else git_blob_sha1(d) for n, d in FILES.items()
    )
    tree = json.loads((storage / "trees" / f"{sha}.json").read_text())
    assert tree["format_version"] == 1
    assert set(tree["files"]) == set(FILES)
    shard = tree["files"][SHARD1]
    assert shard["lfs_sha256"] == hashlib.sha256(FILES[SHARD1]).hexdigest()
    assert shard["size"] == shard["lfs_size"] == len(FILES[SHARD1])
    assert "lfs_sha256" not in tree["files"]["config.json"]
    assert (cache / "CACHEDIR.TAG").is_file()

    methods = [(m, p.split("?")[0]) for m, p in hub.requests if "/resolve/" not in p]
    assert methods == [
        ("GET", f"/api/models/{REPO}/revision/main"),
        ("GET", f"/api/models/{REPO}/tree/{sha}"),
    ]
    assert hub.file_requests() == 2 * len(FILES)  # one HEAD and one GET each
    assert sorted(resolved(hub)) == sorted(2 * list(FILES))


def test_cached_snapshot_needs_no_requests(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = hub.add_repo(REPO, FILES)
    cache = tmp_path / "cache"
    first = snapshot_download(REPO, cache_dir=cache)
    hub.reset_counts()

    assert snapshot_download(REPO, cache_dir=cache, local_files_only=True) == first
    assert snapshot_download(REPO, revision=sha, cache_dir=cache, local_files_only=True) == first
    # Online with the commit sha: the trees/ cache and the snapshot answer everything.
    assert snapshot_download(REPO, revision=sha, cache_dir=cache) == first
    assert hub.requests == []
    # HF_HUB_OFFLINE (read at import time, hence the constant) behaves like local_files_only.
    with monkeypatch.context() as offline:
        offline.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        assert snapshot_download(REPO, cache_dir=cache) == first
    assert hub.requests == []
    # Online by branch: only the revision is resolved.
    assert snapshot_download(REPO, cache_dir=cache) == first
    assert [p for _, p in hub.requests] == [f"/api/models/{REPO}/revision/main"]

    # A snapshot missing a file the cached tree lists is refused offline.
    (Path(first) / SHARD2).unlink()
    with pytest.raises(IncompleteSnapshotError):
        snapshot_download(REPO, cache_dir=cache, local_files_only=True)
    # ... unless the patterns exclude that file.
    partial = snapshot_download(
        REPO, cache_dir=cache, local_files_only=True, ignore_patterns=SHARD2
    )
    assert partial == first


def test_patterns_restrict_the_files_requested(hub: HubServer, tmp_path: Path) -> None:
    hub.add_repo(REPO, FILES)

    path = Path(snapshot_download(REPO, cache_dir=tmp_path / "a", allow_patterns=["*.json"]))
    assert set(files_under(path)) == {"config.json", "model.safetensors.index.json"}
    assert set(resolved(hub)) == {"config.json", "model.safetensors.index.json"}

    hub.reset_counts()
    path = Path(
        snapshot_download(
            REPO, cache_dir=tmp_path / "b", ignore_patterns=["original/*", "*.safetensors"]
        )
    )
    assert set(files_under(path)) == {"config.json", "model.safetensors.index.json"}
    assert set(resolved(hub)) == {"config.json", "model.safetensors.index.json"}


def test_revision_by_branch_and_by_commit(hub: HubServer, tmp_path: Path) -> None:
    first = hub.add_repo(REPO, FILES)
    changed = {**FILES, "config.json": b'{"model_type": "mistral"}\n'}
    del changed["original/consolidated.pth"]
    dev = hub.add_repo(REPO, changed, branch="dev")
    second = hub.add_repo(REPO, {**FILES, "README.md": b"# hi\n"})  # main moves on
    assert len({first, dev, second}) == 3
    cache = tmp_path / "cache"
    storage = cache / "models--org--name"

    assert files_under(Path(snapshot_download(REPO, revision="dev", cache_dir=cache))) == changed
    assert (storage / "refs" / "dev").read_text() == dev
    main = Path(snapshot_download(REPO, cache_dir=cache))
    assert main.name == second and "README.md" in files_under(main)

    hub.reset_counts()
    old = Path(snapshot_download(REPO, revision=first, cache_dir=cache))
    assert old == storage / "snapshots" / first
    assert files_under(old) == FILES
    assert not any("/revision/" in p for _, p in hub.requests)  # a sha needs no repo_info
    # config.json differs between the commits, the shards are shared blobs.
    assert (old / "config.json").resolve() != (
        storage / "snapshots" / dev / "config.json"
    ).resolve()
    assert (old / SHARD1).resolve() == (storage / "snapshots" / dev / SHARD1).resolve()


def test_local_dir_gets_plain_files(hub: HubServer, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, FILES)
    target = tmp_path / "model"

    assert snapshot_download(REPO, local_dir=target, cache_dir=tmp_path / "cache") == str(target)
    assert files_under(target) == FILES
    assert not any(p.is_symlink() for p in target.rglob("*"))
    meta = target / ".cache" / "huggingface"
    assert (meta / "trees" / f"{sha}.json").is_file()
    commit, etag, _ = (meta / "download" / f"{SHARD1}.metadata").read_text().splitlines()
    assert (commit, etag) == (sha, hashlib.sha256(FILES[SHARD1]).hexdigest())
    assert not (tmp_path / "cache" / "models--org--name" / "blobs").exists()

    hub.reset_counts()
    assert snapshot_download(REPO, local_dir=target, local_files_only=True) == str(target)
    assert hub.requests == []


def test_tree_pagination_is_followed(hub: HubServer, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, FILES)
    hub.tree_page_size = 2  # 5 files and 1 folder: 3 pages
    path = Path(snapshot_download(REPO, cache_dir=tmp_path))
    assert files_under(path) == FILES
    trees = [p for _, p in hub.requests if "/tree/" in p]
    assert len(trees) == 3 and all(p.startswith(f"/api/models/{REPO}/tree/{sha}") for p in trees)


def test_errors_map_to_the_client_exceptions(hub: HubServer, tmp_path: Path) -> None:
    sha = hub.add_repo(REPO, FILES)
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/missing", cache_dir=tmp_path)
    with pytest.raises(RevisionNotFoundError):
        snapshot_download(REPO, revision="nope", cache_dir=tmp_path)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "absent.txt", cache_dir=tmp_path)
    assert (tmp_path / "models--org--name" / ".no_exist" / sha / "absent.txt").is_file()


def test_range_requests(hub: HubServer) -> None:
    hub.add_repo(REPO, FILES)
    url = f"{hub.endpoint}/{REPO}/resolve/main/{SHARD1}"
    request = urllib.request.Request(url, headers={"Range": "bytes=10-19"})
    with urllib.request.urlopen(request) as response:
        assert response.status == 206
        assert response.headers["Content-Range"] == f"bytes 10-19/{len(FILES[SHARD1])}"
        assert response.read() == FILES[SHARD1][10:20]
    head = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(head) as response:
        assert response.headers["X-Linked-Etag"] == f'"{hashlib.sha256(FILES[SHARD1]).hexdigest()}"'
        assert response.headers["X-Linked-Size"] == str(len(FILES[SHARD1]))
        assert response.headers["X-Repo-Commit"] is not None
        assert "X-Xet-Hash" not in response.headers
