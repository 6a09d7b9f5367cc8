"""vLLM started as its users start it: ``LLM(model="org/model", load_format="volcache")``,
a repo id on a Hub (the test Hub), with a mirror that the first worker fills and the
next ones, fresh hosts, load from with the Hub up, down or offline.

vLLM runs in subprocesses (loaderplug/testing/vllm_runner.py); the Hub runs in this one.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from loaderplug.testing.hub import HubServer, client_env, share_blobs
from loaderplug.testing.object_server import SeaweedS3
from tests.s3server import BUCKET, fresh_prefix
from tests.s3server import server as server

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.vllm,
    pytest.mark.slow("starts vLLM"),
    # One vLLM start at a time per module under pytest-xdist: each wants the cores.
    pytest.mark.xdist_group("vllm-hub"),
]
REPO_ROOT = Path(__file__).resolve().parent.parent
REPO = "acme/tiny-llama"
FOLDER = "models--acme--tiny-llama"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loaderplug.testing.tiny_llama import write_tiny_llama

    folder = tmp_path_factory.mktemp("original") / "tiny-llama"
    write_tiny_llama(folder, shards=3)
    return folder


def run_vllm(
    cases: list[dict[str, Any]],
    home: Path,
    hub: HubServer,
    volume: Path,
    prefix: tuple[str, ...] = (),
    **env: str,
) -> list[dict[str, Any]]:
    """Each case's generation, from a fresh process whose HF_HOME is ``home``."""
    from loaderplug.testing.vllm_runner import cases_in_subprocess

    environment = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "PYTHONPATH": str(REPO_ROOT),
        "TMPDIR": str(home),
        "LOADERPLUG_MIRROR": str(volume),
        "LOADERPLUG_LOCAL_COPIES": str(home / "loaderplug"),
        "LOADERPLUG_PROGRESS": "0",
        **client_env(hub.endpoint, home),
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        **env,
    }
    return cases_in_subprocess(cases, environment, REPO_ROOT, prefix)


def first_worker(
    llama: Path, hub: HubServer, tmp_path: Path
) -> tuple[str, Path, dict[str, Any], dict[str, Any]]:
    """The repo on the Hub, and the first worker (an empty mirror, the Hub up), then
    vLLM's own loader on the original folder in the same process, for reference: the
    commit, the volume it filled, and the two runs."""
    sha = hub.add_repo(REPO, {p.name: p.read_bytes() for p in llama.iterdir()})
    volume = tmp_path / "volume"
    volume.mkdir()
    first, reference = run_vllm(
        [
            {"model": REPO, "load_format": "volcache"},
            {"model": str(llama), "load_format": "safetensors"},
        ],
        tmp_path / "w1",
        hub,
        volume,
    )
    assert first["ok"] and reference["ok"], first["log"]
    return sha, volume, first, reference


@pytest.mark.parametrize("layout", ["per-repo", "shared"])
def test_vllm_with_a_repo_id_fills_the_mirror_then_loads_from_it_up_down_and_offline(
    llama: Path, hub: HubServer, tmp_path: Path, layout: str
) -> None:
    hub.announce_xet = True
    files = {p.name: p.read_bytes() for p in llama.iterdir()}
    sha, volume, first, reference = first_worker(llama, hub, tmp_path)
    assert first["token_ids"] == reference["token_ids"]
    assert hub.file_requests() > 0
    mirrored = volume / "hub" / FOLDER
    assert (mirrored / "refs" / "main").read_text() == sha
    on_mirror = mirrored / "snapshots" / sha
    assert {p.name: p.read_bytes() for p in on_mirror.iterdir()} == files
    if layout == "shared":
        assert share_blobs(volume / "hub") == 3  # the three weight shards

    # Fresh hosts: the Hub up (no file from it), then offline, then down.
    hub.reset_counts()
    (up,) = run_vllm([{"model": REPO, "load_format": "volcache"}], tmp_path / "w2", hub, volume)
    assert up["ok"], up["log"]
    assert up["token_ids"] == reference["token_ids"]
    assert hub.file_requests() == 0, hub.requests

    (offline,) = run_vllm(
        [{"model": REPO, "load_format": "volcache"}],
        tmp_path / "w3",
        hub,
        volume,
        HF_HUB_OFFLINE="1",
    )
    assert offline["ok"], offline["log"]
    assert offline["token_ids"] == reference["token_ids"]

    hub.stop()
    (down,) = run_vllm(
        [{"model": REPO, "load_format": "volcache"}],
        tmp_path / "w4",
        hub,
        volume,
        TEST_HUB_MAX_RETRIES="0",  # vLLM lists the repo's files; each refusal is retried
    )
    assert down["ok"], down["log"]
    assert down["token_ids"] == reference["token_ids"]


def test_vllms_own_loader_with_a_repo_id_under_loaderplug_run_loads_from_the_mirror(
    llama: Path, hub: HubServer, tmp_path: Path
) -> None:
    """vLLM's default load format, unchanged, under ``loaderplug run``: the first worker's
    downloads fill the mirror, the next worker (a fresh host) makes no file request, and
    then loads with the Hub hung."""
    files = {p.name: p.read_bytes() for p in llama.iterdir()}
    sha = hub.add_repo(REPO, files)
    volume = tmp_path / "volume"
    volume.mkdir()
    run = ("loaderplug", "run", "--")
    case = [{"model": REPO, "load_format": "safetensors"}]
    (first,) = run_vllm(case, tmp_path / "w1", hub, volume, run)
    assert first["ok"], first["log"]
    assert hub.file_requests() > 0
    on_mirror = volume / "hub" / FOLDER / "snapshots" / sha
    assert {n for n in files if n.endswith(".safetensors")} <= {p.name for p in on_mirror.iterdir()}

    hub.reset_counts()
    (second,) = run_vllm(case, tmp_path / "w2", hub, volume, run)
    assert second["ok"], second["log"]
    assert second["token_ids"] == first["token_ids"]
    assert hub.file_requests() == 0, hub.requests

    hub.failing = "hang"
    (hung,) = run_vllm(case, tmp_path / "w3", hub, volume, run, LOADERPLUG_HUB_TIMEOUT_S="2")
    assert hung["ok"], hung["log"]
    assert hung["token_ids"] == first["token_ids"]


def test_vllm_with_a_repo_id_loads_from_a_bucket_mirror(
    llama: Path, hub: HubServer, tmp_path: Path, server: SeaweedS3
) -> None:
    """``LOADERPLUG_MIRROR=s3://...``: a bucket a sync filled from a volume mirror; a
    fresh host's vLLM loads from it with no file from the Hub."""
    import loaderplug

    _, volume, _, reference = first_worker(llama, hub, tmp_path)
    bucket = f"s3://{BUCKET}/{fresh_prefix()}"
    with pytest.MonkeyPatch.context() as patch:
        for name, value in server.env().items():
            patch.setenv(name, value)
        assert loaderplug.sync(volume / "hub", f"{bucket}/hub", progress=False).ok
    hub.reset_counts()
    (from_bucket,) = run_vllm(
        [{"model": REPO, "load_format": "volcache"}],
        tmp_path / "w2",
        hub,
        volume,
        **{**server.env(), "LOADERPLUG_MIRROR": bucket},
    )
    assert from_bucket["ok"], from_bucket["log"]
    assert from_bucket["token_ids"] == reference["token_ids"]
    assert hub.file_requests() == 0, hub.requests
