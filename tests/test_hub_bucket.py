"""Hub downloads served from a bucket (LOADERPLUG_MIRROR=s3://...): the real
huggingface_hub client against the tests' Hub, the bucket a real S3 server filled by
``loaderplug sync`` from a volume mirror an earlier worker filled."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")
from huggingface_hub import constants

import loaderplug
from loaderplug.integrations import huggingface_hub as lp_hub
from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.testing.hub import HubServer
from loaderplug.testing.object_server import SeaweedS3
from tests.s3server import BUCKET, fresh_prefix, key_of
from tests.s3server import s3 as s3
from tests.s3server import server as server
from tests.test_hf_integration import FILES, FOLDER, REPO, snapshot_bytes

pytestmark = pytest.mark.usefixtures("s3")


def fill_bucket(hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """A first worker downloads through a volume mirror; the volume's Hub folder is then
    synced to a bucket. The bucket's URL (LOADERPLUG_MIRROR's) and the commit."""
    sha = hub.add_repo(REPO, FILES)
    volume = tmp_path / "volume"
    volume.mkdir()
    monkeypatch.setenv("LOADERPLUG_MIRROR", str(volume))
    lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache1")
    url = f"s3://{BUCKET}/{fresh_prefix()}"
    assert loaderplug.sync(volume / "hub", f"{url}/hub", progress=False).ok
    monkeypatch.setenv("LOADERPLUG_MIRROR", url)
    hub.reset_counts()
    return url, sha


def test_a_worker_hydrates_a_repo_from_the_bucket_with_no_file_from_the_hub(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, sha = fill_bucket(hub, tmp_path, monkeypatch)
    cache2 = tmp_path / "cache2"
    path = lp_hub.snapshot_download(REPO, cache_dir=cache2)
    assert path == str(cache2.resolve() / FOLDER / "snapshots" / sha)
    assert snapshot_bytes(path) == FILES
    assert not [p for _, p in hub.requests if "/resolve/" in p]
    shard = Path(path) / "model-00001-of-00002.safetensors"
    assert os.readlink(shard) == "../../blobs/" + hashlib.sha256(FILES[shard.name]).hexdigest()
    # The Hub client's own layout: found offline, by branch, as after a download.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert lp_hub.original_snapshot_download(REPO, cache_dir=cache2) == path


def test_one_file_and_a_local_dir_are_served_from_the_bucket(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fill_bucket(hub, tmp_path, monkeypatch)
    config = lp_hub.hf_hub_download(REPO, "config.json", cache_dir=tmp_path / "c3")
    assert Path(config).read_bytes() == FILES["config.json"]
    local = tmp_path / "local"
    lp_hub.snapshot_download(REPO, local_dir=local, allow_patterns=["*.safetensors"])
    assert {p.name for p in local.glob("*.safetensors")} == {
        n for n in FILES if n.endswith(".safetensors")
    }
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (local / name).read_bytes() == FILES[name]
    assert not [p for _, p in hub.requests if "/resolve/" in p]


def test_a_blob_missing_or_corrupt_in_the_bucket_is_downloaded_from_the_hub(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3: SeaweedS3
) -> None:
    url, _ = fill_bucket(hub, tmp_path, monkeypatch)
    blob = hashlib.sha256(FILES["model-00001-of-00002.safetensors"]).hexdigest()
    key = f"{key_of(url)}/hub/{FOLDER}/blobs/{blob}"
    # Same size, other bytes: the hash that names the blob refuses it.
    s3.client().put_object(
        Bucket=BUCKET, Key=key, Body=os.urandom(len(FILES["model-00001-of-00002.safetensors"]))
    )
    path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2")
    assert snapshot_bytes(path) == FILES
    assert [p for _, p in hub.requests if "/resolve/" in p]  # the Hub served it
    s3.client().delete_object(Bucket=BUCKET, Key=key)
    hub.reset_counts()
    path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache3")
    assert snapshot_bytes(path) == FILES


def test_a_bucket_out_of_reach_never_fails_the_download(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sha = hub.add_repo(REPO, FILES)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("LOADERPLUG_MIRROR", f"s3://{BUCKET}/nowhere")
    monkeypatch.setenv("LOADERPLUG_OBJECT_TIMEOUT_S", "2")
    path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache")
    assert snapshot_bytes(path) == FILES
    # The Hub's commit, pinned, and the branch's ref written as a download writes it.
    assert path.endswith(sha)
    assert (tmp_path / "cache" / FOLDER / "refs" / "main").read_text() == sha
    assert not (Path.cwd() / "s3:").exists()  # a URL is never taken for a folder


def test_loaderplug_run_serves_a_programs_downloads_from_the_bucket(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, sha = fill_bucket(hub, tmp_path, monkeypatch)
    program = (
        "import huggingface_hub, sys; "
        f"print(huggingface_hub.snapshot_download({REPO!r}, cache_dir=sys.argv[1]))"
    )
    cache = tmp_path / "run-cache"
    done = subprocess.run(
        ["loaderplug", "run", "--", sys.executable, "-c", program, str(cache)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip().splitlines()[-1]
    assert path == str(cache.resolve() / FOLDER / "snapshots" / sha)
    assert snapshot_bytes(path) == FILES
    assert not [p for _, p in hub.requests if "/resolve/" in p]


def test_a_bucket_behind_the_hub_serves_nothing_of_another_commit(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, old = fill_bucket(hub, tmp_path, monkeypatch)
    newer = hub.add_repo(REPO, {**FILES, "config.json": b'{"model_type": "mistral"}\n'})
    hub_commits.forget_pins()  # a fresh process: the first worker's pin is not this one's
    path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2")
    assert path.endswith(newer) and newer != old
    assert Path(path, "config.json").read_bytes() == b'{"model_type": "mistral"}\n'
    # One file asked alone comes from the same commit as the rest.
    config = lp_hub.hf_hub_download(REPO, "config.json", cache_dir=tmp_path / "cache3")
    assert Path(config).read_bytes() == b'{"model_type": "mistral"}\n'


@pytest.mark.parametrize("mirror", ["s3://My_Bucket/x", "file:///mnt/mirror", "s3://a@b/c"])
def test_a_mirror_url_that_is_no_bucket_never_fails_the_download(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mirror: str
) -> None:
    hub.add_repo(REPO, FILES)
    monkeypatch.setenv("LOADERPLUG_MIRROR", mirror)
    path = lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache")
    assert snapshot_bytes(path) == FILES
