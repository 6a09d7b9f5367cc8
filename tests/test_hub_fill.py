"""A worker whose local Hugging Face cache already holds the model (a warm node, a cache
baked into an image) fills an empty mirror, with no request to the Hub for a file,
whether the Hub is up, down or offline; the next worker then loads from the mirror.

Each worker is a process of its own, transformers' ``from_pretrained`` by repo id, as a
user runs it (the warm one and the next under ``loaderplug run``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loaderplug.testing.hub import HubServer, client_env, share_blobs
from loaderplug.testing.volume import VolumeProfile, mounted
from loaderplug.units import MiB
from tests.conftest import tree_bytes
from tests.hubserver import hub as hub

pytest.importorskip("transformers")

REPO = "acme/llama"
FOLDER = "models--acme--llama"
WORKER = (
    "import transformers\n"
    f"transformers.AutoModelForCausalLM.from_pretrained({REPO!r})\n"
    f"transformers.AutoTokenizer.from_pretrained({REPO!r})\n"
    "print('loaded')\n"
)


def run_python(
    code: str, env: dict[str, str], printed: str, timeout_s: float, hooked: bool = True
) -> subprocess.CompletedProcess[str]:
    """``code`` run by a Python of its own (under ``loaderplug run`` where ``hooked``),
    ``env`` over this process's; it must exit 0 having printed ``printed``."""
    done = subprocess.run(
        [*(["loaderplug", "run"] if hooked else []), sys.executable, "-c", code],
        env={**os.environ, "LOADERPLUG_PROGRESS": "0", **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0 and printed in done.stdout, done.stderr[-3000:]
    return done


def worker(
    hub: HubServer, home: Path, volume: Path | None, **env: str
) -> subprocess.CompletedProcess[str]:
    mirror = {"LOADERPLUG_MIRROR": str(volume)} if volume is not None else {}
    env = {**client_env(hub.endpoint, home), **mirror, **env}
    return run_python(WORKER, env, "loaded", timeout_s=240, hooked=volume is not None)


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


# -- a worker that exits while the fill runs ---------------------------------------------

TINY = "acme/tiny"
TINY_FOLDER = "models--acme--tiny"
# Looks a file up in the warm cache (which offers the commit to the background fill),
# then, with FORK set, forks a child that ends as any program ends (its exit handlers
# run) and says how it ended.
LOOKUP = (
    "import os, sys, huggingface_hub\n"
    f"found = huggingface_hub.try_to_load_from_cache({TINY!r}, 'config.json')\n"
    "print('found', found is not None, flush=True)\n"
    "if os.environ.get('FORK'):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        sys.exit(0)\n"
    "    print('child exited', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)\n"
)


@pytest.fixture
def slow_warm_cache(hub: HubServer, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A warm HF_HOME on a volume that reads 1 MiB/s, whose cache holds the repo (64 MiB
    of weights: a fill from it outlasts the worker's timeout); its mount point and sha."""
    from huggingface_hub import snapshot_download

    home = tmp_path / "home"
    sha = hub.add_repo(TINY, {"config.json": b"{}\n", "model.safetensors": os.urandom(64 * MiB)})
    snapshot_download(TINY, cache_dir=home / "hub")
    slow = VolumeProfile(per_stream_bytes_per_s=MiB, mount_bytes_per_s=MiB)
    with mounted(home, tmp_path / "slow-home", slow) as vol:
        yield vol.mountpoint, sha


def exiting_worker(home: Path, volume: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The lookup under ``loaderplug run``, offline, with a timeout below the fill's time.
    One reader: an exiting process waits for the reads its kernel has in flight on a
    FUSE mount, and the volume's throttle would queue many behind each other."""
    env = {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_OFFLINE": "1",
           "LOADERPLUG_MIRROR": str(volume), "LOADERPLUG_READERS": "1", **env}  # fmt: skip
    return run_python(LOOKUP, env, "found True", timeout_s=30)


def assert_nothing_partial(volume: Path, home: Path) -> None:
    """Every blob published on the mirror is the cache's, whole; no ref until all are."""
    mirrored = volume / "hub" / TINY_FOLDER
    assert not (mirrored / "refs").exists()
    published = tree_bytes(mirrored / "blobs") if (mirrored / "blobs").exists() else {}
    for name, data in published.items():
        assert data == (home / "hub" / TINY_FOLDER / "blobs" / name).read_bytes(), name


@pytest.mark.fuse
@pytest.mark.slow("a process under loaderplug run, its cache on a throttled volume")
def test_a_worker_exits_within_the_fill_wait_and_says_what_it_left(
    slow_warm_cache: tuple[Path, str], tmp_path: Path, volume: Path
) -> None:
    home, sha = slow_warm_cache
    done = exiting_worker(home, volume, LOADERPLUG_FILL_EXIT_WAIT_S="1")
    assert "exiting before the mirror was filled" in done.stderr, done.stderr[-3000:]
    assert f"{TINY} at commit {sha}" in done.stderr
    assert "model.safetensors" in done.stderr
    assert_nothing_partial(volume, home)


@pytest.mark.fuse
@pytest.mark.slow("a process under loaderplug run, its cache on a throttled volume")
def test_a_forked_child_runs_none_of_its_parents_fill(
    slow_warm_cache: tuple[Path, str], tmp_path: Path, volume: Path
) -> None:
    home, _ = slow_warm_cache
    done = exiting_worker(home, volume, FORK="1", LOADERPLUG_FILL_EXIT_WAIT_S="0")
    assert "child exited 0" in done.stdout, done.stderr[-3000:]
    # Said once, by the parent: the child had no fill to leave.
    assert done.stderr.count("exiting before the mirror was filled") == 1, done.stderr
    assert_nothing_partial(volume, home)
