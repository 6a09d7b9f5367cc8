"""A worker whose local Hugging Face cache already holds the model (a warm node, a cache
baked into an image) fills an empty mirror, with no request to the Hub for a file,
whether the Hub is up, down or offline; the next worker then loads from the mirror.

Each worker is a process of its own, transformers' ``from_pretrained`` by repo id, as a
user runs it (the warm one and the next under ``loaderplug run``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loaderplug.testing.hub import HubServer, client_env, share_blobs

pytest.importorskip("transformers")

REPO = "acme/llama"
FOLDER = "models--acme--llama"
WORKER = (
    "import transformers\n"
    f"transformers.AutoModelForCausalLM.from_pretrained({REPO!r})\n"
    f"transformers.AutoTokenizer.from_pretrained({REPO!r})\n"
    "print('loaded')\n"
)


def worker(
    hub: HubServer, home: Path, volume: Path | None, **env: str
) -> subprocess.CompletedProcess[str]:
    hooked = ["loaderplug", "run"] if volume is not None else []
    mirror = {"LOADERPLUG_MIRROR": str(volume)} if volume is not None else {}
    done = subprocess.run(
        [*hooked, sys.executable, "-c", WORKER],
        env={**os.environ, **client_env(hub.endpoint, home), "LOADERPLUG_PROGRESS": "0",
             **mirror, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-3000:]
    return done


@pytest.mark.slow("three transformers processes each")
@pytest.mark.parametrize(
    ("how", "layout"), [("up", "per-repo"), ("down", "shared"), ("offline", "per-repo")]
)
def test_a_warm_local_cache_fills_an_empty_mirror(tmp_path: Path, how: str, layout: str) -> None:
    from loaderplug.testing.tiny_llama import write_tiny_llama

    write_tiny_llama(tmp_path / "llama", shards=2)
    files = {p.name: p.read_bytes() for p in (tmp_path / "llama").iterdir()}
    volume = tmp_path / "volume"
    volume.mkdir()
    with HubServer() as hub:
        hub.announce_xet = layout == "shared"
        sha = hub.add_repo(REPO, files)
        worker(hub, tmp_path / "warm", None)  # stock: the cache a warm node has
        if layout == "shared":
            assert share_blobs(tmp_path / "warm" / "hub") == 2
        hub.reset_counts()
        if how == "down":
            hub.stop()
        offline = {"HF_HUB_OFFLINE": "1"} if how == "offline" else {}
        worker(hub, tmp_path / "warm", volume, **offline)
        assert hub.file_requests() == 0, hub.requests

        mirrored = volume / "hub" / FOLDER
        assert (mirrored / "refs" / "main").read_text() == sha
        assert (mirrored / "trees" / f"{sha}.json").is_file()  # the listing, with the rest
        snapshot = {p.name: p.read_bytes() for p in (mirrored / "snapshots" / sha).iterdir()}
        assert snapshot and all(files[name] == data for name, data in snapshot.items())
        assert {n for n in files if n.endswith(".safetensors")} <= set(snapshot)

        hub.stop()  # the next worker needs nothing of the Hub
        worker(hub, tmp_path / "next", volume)
        assert hub.file_requests() == 0
