"""A Hub that hangs, refuses connections or answers 5xx/429 costs a worker whose mirror
holds the model one timeout: transformers' ``from_pretrained`` by repo id, run as users
run it (under ``loaderplug run``), against a test Hub in each of those states. Only what
is asked about a repo is cut at that timeout: a slow download completes, and leaves the
Hub reachable."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub import fill as hub_fill
from loaderplug.integrations.hub.outage import asks_about, repo_of
from loaderplug.testing.hub import HubServer, client_env
from tests.hubserver import hub as hub

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
        # A repo, a revision or a folder named like a verb: known by the URL's shape.
        ("/api/models/org/resolve", ("model", "org/resolve")),
        ("/api/models/org/resolve/revision/main", ("model", "org/resolve")),
        ("/api/models/gpt2/resolve/main/config.json", ("model", "gpt2")),
        ("/api/models/gpt2/revision/refs/pr/1", ("model", "gpt2")),
        ("/org/resolve/resolve/main/config.json", ("model", "org/resolve")),
        ("/spaces/org/resolve/resolve/main/app.py", ("space", "org/resolve")),
        ("/acme/llama/blob/main/resolve/x.json", None),
    ],
)
def test_each_hub_request_is_known_by_its_repo(path: str, repo: tuple[str, str] | None) -> None:
    assert repo_of(path) == repo


@pytest.mark.parametrize(
    ("method", "path", "repo"),
    [
        ("GET", "/api/models/acme/llama/revision/main", ("model", "acme/llama")),
        ("GET", "/api/models/acme/llama", ("model", "acme/llama")),
        ("GET", "/api/models/acme/llama/tree/abc", ("model", "acme/llama")),
        ("GET", "/api/models/acme/llama/xet-read-token/abc", ("model", "acme/llama")),
        ("POST", "/api/models/acme/llama/paths-info/abc", ("model", "acme/llama")),
        ("HEAD", "/acme/llama/resolve/abc/config.json", ("model", "acme/llama")),
        ("HEAD", "/datasets/acme/data/resolve/main/x.csv", ("dataset", "acme/data")),
        # A file's content, an upload, a commit: never guarded.
        ("GET", "/acme/llama/resolve/abc/model.safetensors", None),
        ("GET", "/gpt2/resolve/main/config.json", None),
        ("GET", "/datasets/acme/data/resolve/main/x.csv", None),
        ("GET", "/api/models/acme/llama/resolve/main/config.json", None),
        ("POST", "/api/models/acme/llama/preupload/main", None),
        ("POST", "/api/models/acme/llama/commit/main", None),
        ("PUT", "/api/models/acme/llama/settings", None),
    ],
)
def test_only_what_is_asked_about_a_repo_is_guarded(
    method: str, path: str, repo: tuple[str, str] | None
) -> None:
    assert asks_about(method, path) == repo


@pytest.mark.parametrize(
    ("method", "path", "repo"),
    [
        # The info of a repo named resolve, at a revision and at its head: asked about.
        ("GET", "/api/models/org/resolve/revision/main", ("model", "org/resolve")),
        ("GET", "/api/models/org/resolve", ("model", "org/resolve")),
        ("GET", "/api/datasets/org/resolve/tree/main", ("dataset", "org/resolve")),
        # A listing of a folder named resolve: asked about.
        ("GET", "/api/models/acme/llama/tree/main/resolve", ("model", "acme/llama")),
        ("GET", "/api/models/acme/llama/tree/main/resolve/sub", ("model", "acme/llama")),
        ("POST", "/api/models/acme/llama/paths-info/main/resolve", ("model", "acme/llama")),
        # A file of the repo named resolve: its metadata asked about, its content not.
        ("HEAD", "/org/resolve/resolve/main/config.json", ("model", "org/resolve")),
        ("GET", "/org/resolve/resolve/main/config.json", None),
        ("GET", "/api/models/org/resolve/resolve/main/config.json", None),
        # A file in a folder named resolve, of a repo of one part and of two.
        ("GET", "/acme/llama/resolve/main/resolve/config.json", None),
        ("HEAD", "/gpt2/resolve/main/resolve/config.json", ("model", "gpt2")),
    ],
)
def test_a_download_is_known_by_its_url_shape_not_by_a_resolve_in_it(
    method: str, path: str, repo: tuple[str, str] | None
) -> None:
    assert asks_about(method, path) == repo


@pytest.mark.parametrize(
    ("path", "held", "repo"),
    [
        # A revision named like a verb, of a one-part repo: read as the repo held.
        ("/api/models/gpt2/revision/tag/main", {"gpt2"}, ("model", "gpt2")),
        ("/api/models/gpt2/revision/tag/main", {"gpt2/revision"}, ("model", "gpt2/revision")),
        # A repo the mirror does not hold is never guarded, however it reads.
        ("/api/models/org/resolve/revision/main", {"org"}, None),
        ("/api/models/org/resolve/revision/main", set(), None),
    ],
)
def test_a_path_that_reads_two_ways_is_read_as_the_repo_the_mirror_holds(
    path: str, held: set[str], repo: tuple[str, str] | None
) -> None:
    assert asks_about("GET", path, lambda _type, repo_id: repo_id in held) == repo


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


SLOW = "acme/slow"
SLOW_FILES = {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": os.urandom(300_000)}


@pytest.fixture
def hooked(hub: HubServer, volume: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """The hook on in this process, with a mirror that holds the repo (a first download
    filled it with the config) and Hub timeouts of 1 s, loaderplug's and
    huggingface_hub's own for a file's content."""
    import huggingface_hub
    from huggingface_hub import constants

    from loaderplug.integrations import huggingface_hub as lp_hub

    monkeypatch.setenv("LOADERPLUG_HUB_TIMEOUT_S", "1")
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    hub.add_repo(SLOW, SLOW_FILES)
    hub_commits.forget_pins()
    with lp_hub.installed():
        huggingface_hub.hf_hub_download(SLOW, "config.json")
        assert (volume / "hub" / "models--acme--slow" / "refs").is_dir()
        yield hub
        hub_fill.wait()
    hub_commits.forget_pins()


def finishes(call: Callable[[], Any]) -> Any:
    """What ``call`` returns or raises, run on a thread so that a test of a hang cannot
    hang the suite (a call still waiting after a minute fails the test)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert outcome, "still waiting for the Hub"
    return outcome[0]


@pytest.mark.slow("a download the Hub is seconds slow to start")
def test_a_download_slower_than_its_timeout_is_resumed_and_the_hub_stays_reachable(
    hooked: HubServer,
) -> None:
    import huggingface_hub

    hooked.slow_downloads(2.5)  # past huggingface_hub's and loaderplug's timeouts, once
    path = huggingface_hub.hf_hub_download(SLOW, "model.safetensors")
    assert Path(path).read_bytes() == SLOW_FILES["model.safetensors"]
    hooked.reset_counts()
    info = huggingface_hub.HfApi().model_info(SLOW)  # asked of the Hub, not taken as offline
    assert info.id == SLOW and hooked.requests == [("GET", f"/api/models/{SLOW}")]


@pytest.mark.slow("a download the Hub is seconds slow to start")
def test_a_download_with_no_timeout_of_its_own_is_not_cut_at_loaderplugs(
    hooked: HubServer,
) -> None:
    import huggingface_hub

    hooked.slow_downloads(2.5)  # past LOADERPLUG_HUB_TIMEOUT_S
    url = huggingface_hub.hf_hub_url(SLOW, "model.safetensors")
    response = huggingface_hub.get_session().get(url)
    assert response.status_code == 200
    assert response.content == SLOW_FILES["model.safetensors"]


def test_a_hung_request_about_a_repo_is_cut_at_the_timeout(hooked: HubServer) -> None:
    import huggingface_hub

    hooked.failing = "hang"
    api = huggingface_hub.HfApi()
    cut = finishes(lambda: api.model_info(SLOW))
    assert isinstance(cut, Exception) and "timed out" in str(cut).lower(), repr(cut)
    # From then on the repo is asked nothing: huggingface_hub is told it is offline.
    again = finishes(lambda: api.model_info(SLOW))
    assert isinstance(again, huggingface_hub.errors.OfflineModeIsEnabled), repr(again)


def test_the_mirror_is_not_looked_at_for_a_download_or_an_upload() -> None:
    def holds(repo_type: str, repo_id: str) -> bool:
        raise AssertionError(f"the mirror looked at for {repo_type} {repo_id}")

    assert asks_about("GET", "/acme/llama/resolve/main/model.safetensors", holds) is None
    assert asks_about("POST", "/api/models/acme/llama/commit/main", holds) is None
