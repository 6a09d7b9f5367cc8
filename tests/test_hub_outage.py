"""A Hub that hangs, refuses connections or answers 5xx/429 costs a worker whose mirror
holds the model one timeout: transformers' ``from_pretrained`` by repo id, run as users
run it (under ``loaderplug run``), against a test Hub in each of those states."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loaderplug.integrations.hub_outage import repo_of
from loaderplug.testing.hub import HubServer, client_env

pytest.importorskip("transformers")

REPO = "acme/llama"
# A worker: the model and its tokenizer by repo id, then one line saying it worked.
WORKER = (
    "import transformers\n"
    f"model = transformers.AutoModelForCausalLM.from_pretrained({REPO!r})\n"
    f"tokenizer = transformers.AutoTokenizer.from_pretrained({REPO!r})\n"
    "print('loaded', type(model).__name__, len(tokenizer('hello')['input_ids']) > 0)\n"
)


@pytest.mark.parametrize(
    ("path", "repo"),
    [
        ("/api/models/acme/llama", ("model", "acme/llama")),
        ("/api/models/acme/llama/revision/main", ("model", "acme/llama")),
        ("/api/models/gpt2/revision/main", ("model", "gpt2")),
        ("/api/models/gpt2", ("model", "gpt2")),
        ("/api/datasets/acme/data/tree/abc", ("dataset", "acme/data")),
        ("/acme/llama/resolve/abc/config.json", ("model", "acme/llama")),
        ("/gpt2/resolve/main/config.json", ("model", "gpt2")),
        ("/datasets/acme/data/resolve/main/x.csv", ("dataset", "acme/data")),
        ("/api/whoami-v2", None),
    ],
)
def test_each_hub_request_is_known_by_its_repo(path: str, repo: tuple[str, str] | None) -> None:
    assert repo_of(path) == repo


def worker(
    hub: HubServer, home: Path, volume: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["loaderplug", "run", sys.executable, "-c", WORKER],
        env={**os.environ, **client_env(hub.endpoint, home), "LOADERPLUG_MIRROR": str(volume),
             "LOADERPLUG_PROGRESS": "0", "LOADERPLUG_HUB_TIMEOUT_S": "2", **env},
        capture_output=True,
        text=True,
        timeout=240,  # stock waits on a hung Hub for as long as it is let
    )  # fmt: skip


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, bytes], Path]:
    """The model's files, and a mirror a first worker filled with them (the Hub up)."""
    from loaderplug.testing.tiny_llama import write_tiny_llama

    root = tmp_path_factory.mktemp("outage")
    write_tiny_llama(root / "llama", shards=2)
    files = {p.name: p.read_bytes() for p in (root / "llama").iterdir()}
    volume = root / "volume"
    volume.mkdir()
    with HubServer() as hub:
        hub.add_repo(REPO, files)
        first = worker(hub, root / "home1", volume)
        assert first.returncode == 0 and "loaded" in first.stdout, first.stderr[-2000:]
    return files, volume


@pytest.mark.slow("a transformers process per state of the Hub")
@pytest.mark.parametrize("failing", ["hang", "500", "429", "stopped"])
def test_a_worker_whose_mirror_holds_the_model_is_not_held_up_by_the_hub(
    tmp_path: Path, failing: str, filled: tuple[dict[str, bytes], Path]
) -> None:
    files, volume = filled
    with HubServer() as hub:  # the same repo, at the same commit, in trouble
        hub.add_repo(REPO, files)
        hub.become(failing)
        second = worker(hub, tmp_path / "home2", volume)
        assert second.returncode == 0, second.stderr[-3000:]
        assert "loaded LlamaForCausalLM True" in second.stdout
        assert hub.file_requests() == 0, hub.requests
        # One request at most reached the Hub before it counted as out of reach.
        assert len(hub.requests) <= 1, hub.requests
