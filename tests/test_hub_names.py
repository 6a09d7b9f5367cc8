"""Names a Hub call gives (repo id, repo type, revision, filename) are checked before the
hook uses them as paths: a bad one raises what stock huggingface_hub raises for it, with
the Hub up, down or offline, and nothing is created or changed outside the local cache
or the mirror's model folder."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("huggingface_hub")
from huggingface_hub import constants
from huggingface_hub._local_folder import _validate_relative_filename
from huggingface_hub.utils import http_backoff

from loaderplug.integrations import huggingface_hub as lp_hub
from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub import fill as hub_fill
from loaderplug.integrations.hub import mirror as hub_mirror
from loaderplug.integrations.hub.names import filename_problem, ref_problem
from loaderplug.testing.hub import HubServer

REPO = "acme/names"
FOLDER = "models--acme--names"
FILES = {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": os.urandom(4096)}
STATES = ["up", "down", "offline"]


# -- the rules, against stock's ------------------------------------------------------

FILENAMES = [
    "config.json",
    "sub/dir/file.bin",
    "./config.json",
    "a\\b.txt",
    "../x",
    "../../../../x/y",
    "a/../../b",
    "..\\..\\x",
    "sub/..",
    "/etc/passwd",
    "C:/x",
    "D:x",
    "a/C:x",
    "\\\\host\\share\\x",
]


@pytest.mark.parametrize("name", FILENAMES)
def test_a_filename_is_refused_exactly_where_stock_refuses_it(name: str) -> None:
    try:
        _validate_relative_filename(name)
        stock_refuses = False
    except ValueError:
        stock_refuses = True
    assert bool(filename_problem(name)) == stock_refuses


@pytest.mark.parametrize(
    "revision",
    ["main", "v1.0", "refs/pr/1", "refs/convert/parquet", "release-2024_01", "a" * 40, "abc1234"],
)
def test_a_branch_tag_or_commit_names_a_ref(revision: str) -> None:
    assert ref_problem(revision) == ""


@pytest.mark.parametrize(
    "revision",
    ["", "..", "../x", "a/../b", "/abs", ".hidden", "a/.b", "a//b", "a/", "x.lock", "a.",
     "a\\b", "a b", "@", "a@{1}", "a\x00b", "a:b"],
)  # fmt: skip
def test_a_path_that_is_no_ref_name_is_refused(revision: str) -> None:
    assert ref_problem(revision)


def test_the_mirror_never_reads_or_writes_a_ref_outside_refs(tmp_path: Path) -> None:
    folder = tmp_path / "repo"
    (folder / "refs").mkdir(parents=True)
    outside = tmp_path / "victim"
    outside.write_text("b" * 40)
    assert hub_mirror.resolve_commit(folder, "../../victim") is None
    with pytest.raises(ValueError, match="no ref written"):
        hub_mirror.write_ref(folder, "../../victim", "a" * 40, fsync=False)
    assert outside.read_text() == "b" * 40


# -- the calls, as users make them -------------------------------------------------


def in_state(state: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub as the next call finds it: answering, refusing connections, or the process
    offline (HF_HUB_OFFLINE=1)."""
    hub_commits.forget_pins()  # a new worker: nothing learned while the Hub was up
    if state == "down":
        with socket.socket() as s:  # nothing listens where the Hub is now
            s.bind(("127.0.0.1", 0))
            endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
        monkeypatch.setattr(constants, "ENDPOINT", endpoint)
        template = endpoint + "/{repo_id}/resolve/{revision}/{filename}"
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
        # huggingface_hub retries a refused connection for some 23 s: once will do.
        monkeypatch.setitem(http_backoff.__kwdefaults__, "max_retries", 0)
    elif state == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def outside(root: Path, allowed: list[Path]) -> dict[str, tuple[str, str]]:
    """Every path under ``root`` but those under ``allowed``: its kind and content (a
    file's hash, a link's target), what a write outside them would change."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            if any(path == a or a in path.parents for a in allowed):
                continue
            if path.is_symlink():
                state[str(path)] = ("link", os.readlink(path))
            elif path.is_file():
                state[str(path)] = ("file", hashlib.sha256(path.read_bytes()).hexdigest())
            else:
                state[str(path)] = ("dir", "")
    return state


def outcome(call: Callable[[], Any]) -> type[BaseException] | str:
    """The type of what ``call`` raises, or what it returns."""
    try:
        return str(call())
    except Exception as exc:
        return type(exc)


@pytest.fixture
def filled(hub: HubServer, tmp_path: Path, volume: Path) -> str:
    """A mirror holding the repo (a first worker's download filled it); its commit."""
    sha = hub.add_repo(REPO, FILES)
    lp_hub.snapshot_download(REPO, cache_dir=tmp_path / "first")
    hub_fill.wait()
    assert (volume / "hub" / FOLDER / "refs" / "main").read_text() == sha
    return sha


BAD_FILES = [
    {"filename": "../../../../escaped/x"},
    {"filename": "a/../../../../../escaped/x"},
    {"filename": "..\\..\\escaped"},
    {"filename": "/tmp/escaped-by-loaderplug"},
    {"filename": "x", "subfolder": "../../../../escaped"},
    {"filename": "config.json", "repo_type": "../../../escaped"},
]


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("into", ["cache_dir", "local_dir"])
@pytest.mark.parametrize("bad", BAD_FILES, ids=lambda b: "-".join(map(str, b.values())))
def test_a_bad_filename_raises_what_stock_raises_and_writes_nothing_outside(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    filled: str,
    monkeypatch: pytest.MonkeyPatch,
    state: str,
    into: str,
    bad: dict[str, str],
) -> None:
    in_state(state, monkeypatch)
    deep = tmp_path / "deep" / "a" / "b"  # room for the '..' to climb into, and be seen
    caches = [deep / "stock", deep / "hooked"]
    before = outside(tmp_path, [*caches, volume / "hub" / FOLDER])

    def call(download: Callable[..., Any], folder: Path) -> Any:
        # A local_dir download keeps huggingface_hub's own files in the cache_dir too.
        where = {into: folder} if into == "cache_dir" else {into: folder, "cache_dir": folder}
        return outcome(lambda: download(REPO, **where, **bad))

    stock = call(lp_hub.original_hf_hub_download, caches[0])
    hooked = call(lp_hub.hf_hub_download, caches[1])
    assert stock is ValueError
    assert hooked is stock
    assert outside(tmp_path, [*caches, volume / "hub" / FOLDER]) == before
    assert not Path("/tmp/escaped-by-loaderplug").exists()


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("call", ["hf_hub_download", "snapshot_download", "lookup"])
def test_a_revision_that_climbs_raises_what_stock_raises_and_rewrites_nothing_outside(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    filled: str,
    monkeypatch: pytest.MonkeyPatch,
    state: str,
    call: str,
) -> None:
    """``refs/../../../victim`` from the mirror's repo folder is a file on the volume
    (anyone who writes the mirror can plant a commit there); from the local cache's, a
    file of the worker's. Stock reads it at most; the hook must not write it."""
    (volume / "victim").write_text(filled)  # what the mirror's side of the climb finds
    victim = tmp_path / "victim"
    victim.write_text("precious")
    revision = "../../../victim"
    in_state(state, monkeypatch)
    caches = [tmp_path / "stock", tmp_path / "hooked"]  # each climbs to tmp_path/victim
    before = outside(tmp_path, [*caches, volume / "hub" / FOLDER])

    def run(functions: dict[str, Callable[..., Any]], cache: Path) -> Any:
        options = {"revision": revision, "cache_dir": cache}
        if call == "snapshot_download":
            return outcome(lambda: functions[call](REPO, **options))
        return outcome(lambda: functions[call](REPO, "config.json", **options))

    stock = run(
        {
            "hf_hub_download": lp_hub.original_hf_hub_download,
            "snapshot_download": lp_hub.original_snapshot_download,
            "lookup": lp_hub.original_try_to_load_from_cache,
        },
        caches[0],
    )
    hooked = run(
        {
            "hf_hub_download": lp_hub.hf_hub_download,
            "snapshot_download": lp_hub.snapshot_download,
            "lookup": lp_hub.try_to_load_from_cache,
        },
        caches[1],
    )
    hub_fill.wait()
    assert hooked == stock, (hooked, stock)
    assert victim.read_text() == "precious"
    assert outside(tmp_path, [*caches, volume / "hub" / FOLDER]) == before
