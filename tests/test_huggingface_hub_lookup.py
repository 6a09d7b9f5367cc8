"""``huggingface_hub.try_to_load_from_cache`` with the Hub hook on stays a lookup:
transformers and diffusers call it as one. It answers what the original answers (or,
for a file the local cache lacks, what the mirror holds), asks the Hub nothing, writes
nothing to the mirror, and a failure of the hook's own work behind it is a warning
naming its cause."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("huggingface_hub")
import huggingface_hub

from loaderplug.integrations import huggingface_hub as lp_hub
from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub import fill as hub_fill
from loaderplug.integrations.hub import mirror as hub_mirror
from loaderplug.testing.hub import HubServer

REPO = "acme/lookup"
FOLDER = "models--acme--lookup"
FILES = {
    "config.json": b'{"model_type": "llama"}\n',
    "model.safetensors": os.urandom(100_000),
    "tokenizer.json": b"{}\n",
}


@pytest.fixture
def hooks() -> Iterator[None]:
    """The hook installed in a process that has pinned no commit yet."""
    hub_commits.forget_pins()
    with lp_hub.installed():
        yield
    hub_fill.wait()
    hub_commits.forget_pins()


def warm_cache(hub: HubServer, cache: Path) -> str:
    """A local cache holding the repo, as stock huggingface_hub left it; its sha."""
    sha = hub.add_repo(REPO, FILES)
    lp_hub.original_snapshot_download(REPO, cache_dir=cache)
    return sha


def mirror_state(volume: Path) -> dict[str, tuple[int, int]]:
    """Every path under the mirror, with its size and mtime: what a write would change."""
    return {
        str(p.relative_to(volume)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(volume.rglob("*"))
    }


def lookup(cache: Path, filename: str = "config.json") -> Any:
    found = huggingface_hub.try_to_load_from_cache(REPO, filename, cache_dir=cache)
    hub_fill.wait()  # whatever the lookup left to the fill thread is done
    return found


def test_a_lookup_the_local_cache_answers_makes_no_request_and_fills_only_from_the_cache(
    hub: HubServer, tmp_path: Path, volume: Path, hooks: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A warm cache without the commit's file listing: the fill the lookup offers cannot
    check what it would publish, and leaves the mirror to the next download, which asks
    the Hub for the listing."""
    cache = tmp_path / "cache"
    sha = warm_cache(hub, cache)
    shutil.rmtree(cache / FOLDER / "trees")
    stock = lp_hub.original_try_to_load_from_cache(REPO, "config.json", cache_dir=cache)
    hub.reset_counts()
    with caplog.at_level(logging.DEBUG, logger="loaderplug"):
        found = lookup(cache)
    assert found == stock and isinstance(found, str)
    assert hub.requests == []
    assert mirror_state(volume) == {}
    assert any("no file listing" in r.getMessage() for r in caplog.records), caplog.text

    huggingface_hub.hf_hub_download(REPO, "config.json", cache_dir=cache)
    assert (volume / "hub" / FOLDER / "snapshots" / sha / "config.json").read_bytes() == (
        FILES["config.json"]
    )


@pytest.mark.parametrize("mirror", ["with its listing", "without a listing"])
def test_a_lookup_the_mirror_answers_makes_no_request_and_no_mirror_write(
    hub: HubServer, tmp_path: Path, volume: Path, hooks: None, mirror: str
) -> None:
    sha = hub.add_repo(REPO, FILES)
    lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache1")  # fills the mirror
    if mirror == "without a listing":
        shutil.rmtree(volume / "hub" / FOLDER / "trees")
    before = mirror_state(volume)
    hub_commits.forget_pins()  # a new worker
    hub.reset_counts()
    cache = tmp_path / "cache2"
    found = lookup(cache)
    assert found == str(cache.resolve() / FOLDER / "snapshots" / sha / "config.json")
    assert Path(found).read_bytes() == FILES["config.json"]
    assert hub.requests == []
    assert mirror_state(volume) == before


def test_a_lookup_whose_fill_fails_warns_once_naming_the_cause(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    hooks: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache = tmp_path / "cache"
    warm_cache(hub, cache)
    stock = lp_hub.original_try_to_load_from_cache(REPO, "config.json", cache_dir=cache)

    def full_volume(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hub_mirror, "sync_snapshot", full_volume)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="loaderplug"):
        assert lookup(cache) == stock
        assert lookup(cache, "tokenizer.json") is not None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "OSError" in warnings[0].getMessage()
    assert "No space left on device" in warnings[0].getMessage()
    assert any(r.exc_info and r.exc_info[0] is OSError for r in caplog.records), caplog.text


def test_a_lookup_the_mirror_fails_to_answer_warns_once_naming_the_cause(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    hooks: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub.add_repo(REPO, FILES)
    lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache1")  # fills the mirror
    hub_commits.forget_pins()

    def failing_volume(*args: Any, **kwargs: Any) -> Any:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(hub_mirror, "hydrate_cache", failing_volume)
    cache = tmp_path / "cache2"
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="loaderplug"):
        assert lookup(cache) is None  # what the original answers for an empty cache
        assert lookup(cache, "tokenizer.json") is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert "OSError" in warnings[0].getMessage()
    assert "Input/output error" in warnings[0].getMessage()
    assert any(r.exc_info and r.exc_info[0] is OSError for r in caplog.records), caplog.text
