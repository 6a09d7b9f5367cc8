"""The Hub is the authority on what a commit holds: where it answers, a file the mirror
lists but the Hub's commit does not hold is never served, a file whose mirror entry
names other bytes is served as the Hub names it (or downloaded), and the cost is one
listing request per commit and process. Offline or with the Hub down, the mirror is
served as it lists itself, and the log says it was not verified."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
from huggingface_hub import constants
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.utils import http_backoff

from loaderplug.integrations import huggingface_hub as lp_hub
from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub import fill as hub_fill
from loaderplug.testing.hub import HubServer, git_blob_sha1

REPO = "acme/authority"
FOLDER = "models--acme--authority"
CONFIG = b'{"model_type": "llama"}\n'
# What a writer of the volume would have a worker run: code of its choosing.
PLANTED = b'{"model_type": "llama", "auto_map": {"AutoModel": "evil.Model"}}\n'
WEIGHTS = os.urandom(8192)


def files(with_config: bool = True) -> dict[str, bytes]:
    held = {"model.safetensors": WEIGHTS, "tokenizer.json": b"{}\n"}
    return {**held, "config.json": CONFIG} if with_config else held


@pytest.fixture
def worker() -> None:
    """Each test a new worker: no pin, outage or listing learned before it."""
    hub_commits.forget_pins()


def fill(hub: HubServer, tmp_path: Path, volume: Path, held: dict[str, bytes]) -> Path:
    """A first worker's download fills the mirror; its folder for the repo."""
    hub.add_repo(REPO, held)
    lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "first")
    hub_fill.wait()
    hub_commits.forget_pins()  # the next call is another worker's
    hub.reset_counts()
    return volume / "hub" / FOLDER


def plant(mirror: Path, commit: str, path: str, data: bytes) -> str:
    """Give the mirror's commit ``path`` with ``data``, as a writer of the volume can: a
    blob named by its hash, the snapshot's link and the listing's entry. The blob's name."""
    blob = hashlib.sha256(data).hexdigest() if path.endswith(".safetensors") else None
    entry: dict[str, object] = {"size": len(data), "blob_id": git_blob_sha1(data)}
    if blob is not None:
        entry.update(lfs_sha256=blob, lfs_size=len(data))
    name = blob or git_blob_sha1(data)
    (mirror / "blobs" / name).write_bytes(data)
    link = mirror / "snapshots" / commit / path
    link.unlink(missing_ok=True)
    link.symlink_to(f"../../blobs/{name}")
    listing = mirror / "trees" / f"{commit}.json"
    data_ = json.loads(listing.read_text())
    data_["files"][path] = entry
    listing.write_text(json.dumps(data_, indent=1))
    return name


def tree_requests(hub: HubServer) -> list[str]:
    return [p for _, p in hub.requests if "/tree/" in p]


def file_gets(hub: HubServer) -> list[str]:
    return [p.rsplit("/", 1)[-1] for m, p in hub.requests if m == "GET" and "/resolve/" in p]


def test_a_file_the_hubs_commit_does_not_hold_is_never_served(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    worker: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    mirror = fill(hub, tmp_path, volume, files(with_config=False))
    sha = (mirror / "refs" / "main").read_text()
    plant(mirror, sha, "config.json", PLANTED)
    with pytest.raises(EntryNotFoundError) as stock:
        lp_hub.original_hf_hub_download(REPO, "config.json", cache_dir=tmp_path / "stock")
    hub.reset_counts()
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING), pytest.raises(EntryNotFoundError) as hooked:
        lp_hub.hf_hub_download(REPO, "config.json", cache_dir=cache)
    assert type(hooked.value) is type(stock.value)
    assert not (cache / FOLDER / "snapshots" / sha / "config.json").exists()
    assert len(tree_requests(hub)) == 1  # the Hub was asked what the commit holds
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "otherwise than the Hub" in warned and "config.json: not a file of the commit" in warned
    # A snapshot of the commit gets exactly what the Hub's commit holds.
    path = Path(lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2"))
    assert {p.name: p.read_bytes() for p in path.iterdir()} == files(with_config=False)
    assert len(tree_requests(hub)) == 1 and file_gets(hub) == []
    # The mirror's listing is the Hub's again: an offline worker is not given it either.
    listed = json.loads((mirror / "trees" / f"{sha}.json").read_text())["files"]
    assert sorted(listed) == sorted(files(with_config=False))


@pytest.mark.parametrize("path", ["config.json", "model.safetensors"])
@pytest.mark.parametrize("genuine", ["kept", "removed"])
def test_a_file_the_mirror_lists_otherwise_is_served_as_the_hub_names_it(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    worker: None,
    path: str,
    genuine: str,
) -> None:
    """A git-stored file is named by its blob id, an LFS one by its sha256: either way
    the Hub's name picks the bytes, whatever the mirror's listing says."""
    mirror = fill(hub, tmp_path, volume, files())
    sha = (mirror / "refs" / "main").read_text()
    genuine_blob = os.path.basename(os.readlink(mirror / "snapshots" / sha / path))
    forged = PLANTED if path == "config.json" else os.urandom(len(WEIGHTS))
    plant(mirror, sha, path, forged)
    if genuine == "removed":
        (mirror / "blobs" / genuine_blob).unlink()
    found = lp_hub.hf_hub_download(REPO, path, cache_dir=tmp_path / "cache")
    assert Path(found).read_bytes() == files()[path]
    # Served from the mirror where it holds the Hub's blob, else downloaded as stock does.
    assert file_gets(hub) == ([] if genuine == "kept" else [path])
    assert len(tree_requests(hub)) == 1


@pytest.mark.parametrize("how", ["offline", "down"])
def test_without_the_hub_the_mirror_is_served_and_said_to_be_unverified(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    worker: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    mirror = fill(hub, tmp_path, volume, files(with_config=False))
    sha = (mirror / "refs" / "main").read_text()
    plant(mirror, sha, "config.json", PLANTED)
    if how == "offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        monkeypatch.setitem(http_backoff.__kwdefaults__, "max_retries", 0)
    with caplog.at_level(logging.INFO, logger="loaderplug"):
        found = lp_hub.hf_hub_download(REPO, "config.json", cache_dir=tmp_path / "cache")
    assert Path(found).read_bytes() == PLANTED  # as before: who writes the mirror decides
    said = [r.getMessage() for r in caplog.records if "not verified" in r.getMessage()]
    assert len(said) == 1 and sha in said[0], caplog.text
    assert {"offline": "HF_HUB_OFFLINE", "down": "could not be reached"}[how] in said[0]


def test_the_cost_is_one_listing_request_per_commit(
    hub: HubServer, tmp_path: Path, volume: Path, worker: None
) -> None:
    mirror = fill(hub, tmp_path, volume, files())
    sha = (mirror / "refs" / "main").read_text()
    cache = tmp_path / "cache"
    for name in ("config.json", "tokenizer.json"):
        lp_hub.hf_hub_download(REPO, name, cache_dir=cache, revision=sha)
    lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2", revision=sha)
    assert tree_requests(hub) == [f"/api/models/{REPO}/tree/{sha}?recursive=true&expand=false"]
    assert hub.requests == [("GET", tree_requests(hub)[0])]  # no file, no other request


def test_a_lookup_asks_nothing_and_keeps_to_a_listing_the_process_has(
    hub: HubServer, tmp_path: Path, volume: Path, worker: None
) -> None:
    mirror = fill(hub, tmp_path, volume, files(with_config=False))
    sha = (mirror / "refs" / "main").read_text()
    plant(mirror, sha, "config.json", PLANTED)
    lp_hub.hf_hub_download(REPO, "tokenizer.json", cache_dir=tmp_path / "cache")
    hub.reset_counts()
    found = lp_hub.try_to_load_from_cache(REPO, "config.json", cache_dir=tmp_path / "cache")
    assert not isinstance(found, str)  # known not to exist, as the Hub's listing says
    assert hub.requests == []
