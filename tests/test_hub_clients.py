"""Hub downloads as the libraries users run make them: transformers' ``from_pretrained``
of a repo id, huggingface_hub's own cache tools, every parameter of the wrapped
functions, against mirrors laid out both ways huggingface_hub lays out a cache (blobs
per repo, and the shared Xet store), with the test Hub up, down and offline."""

from __future__ import annotations

import inspect
import json
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("huggingface_hub")
pytest.importorskip("torch")
pytest.importorskip("transformers")

import huggingface_hub
import torch
import transformers
from huggingface_hub import constants

from loaderplug.integrations import huggingface_hub as lp_hub
from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.testing.hub import HubServer, share_blobs
from loaderplug.testing.tiny_llama import write_tiny_llama

REPO = "acme/llama"
FOLDER = "models--acme--llama"
HOWS = ["up", "down", "offline"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    folder = tmp_path_factory.mktemp("llama")
    write_tiny_llama(folder, shards=2)
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def llama_folder(llama: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama-original")
    for name, data in llama.items():
        (folder / name).write_bytes(data)
    return folder


@pytest.fixture(autouse=True)
def transformers_on_the_test_hub(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers keeps one ``HfApi``, which took the endpoint of its first use."""
    from transformers.utils import hub as transformers_hub

    monkeypatch.setattr(transformers_hub, "_hf_api", None)


@pytest.fixture
def hooks() -> Iterator[None]:
    """loaderplug's wrappers installed, as vLLM's plugin installs them; a fresh process's
    pins (each worker below stands for a process of its own)."""
    hub_commits.forget_pins()
    with lp_hub.installed():
        yield
    hub_commits.forget_pins()


def new_worker() -> None:
    """What a new process starts with: no commit pinned, no outage remembered."""
    hub_commits.forget_pins()


def hub_out_of_reach(how: str, hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``down``: the Hub stops answering (nothing listens where it was); ``offline``:
    HF_HUB_OFFLINE=1; ``up``: as it is."""
    if how == "down":
        hub.stop()
        huggingface_hub.close_session()  # no kept-alive connection to the old server
        from huggingface_hub.utils import _http

        # huggingface_hub retries a refused connection 5 times over some 23 s: once will do.
        for backoff in (_http._http_backoff_base, _http.http_backoff, _http.http_stream_backoff):
            if "max_retries" in (backoff.__kwdefaults__ or {}):
                monkeypatch.setitem(backoff.__kwdefaults__, "max_retries", 0)
    elif how == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def from_pretrained(cache: Path) -> tuple[Any, Any, Any]:
    """What a transformers user writes: config, tokenizer and model, by repo id."""
    config = transformers.AutoConfig.from_pretrained(REPO, cache_dir=cache)
    tokenizer = transformers.AutoTokenizer.from_pretrained(REPO, cache_dir=cache)
    model = transformers.AutoModelForCausalLM.from_pretrained(REPO, cache_dir=cache)
    return config, tokenizer, model


def logits(model: Any, tokenizer: Any) -> Any:
    ids = tokenizer("hello world the", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


def first_worker(hub: HubServer, tmp_path: Path, volume: Path, layout: str) -> None:
    """The first worker downloads through transformers and fills the mirror; with
    ``layout="shared"`` the mirror is then laid out as a Xet-era HF_HOME would be."""
    from_pretrained(tmp_path / "cache1")
    assert hub.file_requests() > 0
    if layout == "shared":
        assert share_blobs(volume / "hub") == 2  # both weight shards
        assert (volume / "hub" / "blobs" / ".huggingface-shared-blobs").is_file()


@pytest.mark.slow("transformers processes, worker after worker")
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("layout", ["per-repo", "shared"])
def test_transformers_loads_a_repo_id_from_the_mirror(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    hooks: None,
    llama: dict[str, bytes],
    llama_folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    layout: str,
) -> None:
    hub.announce_xet = True
    sha = hub.add_repo(REPO, llama)
    first_worker(hub, tmp_path, volume, layout)
    mirrored = volume / "hub" / FOLDER
    assert (mirrored / "refs" / "main").read_text() == sha
    assert {p.name for p in (mirrored / "snapshots" / sha).iterdir()} == set(llama)

    new_worker()
    hub.reset_counts()
    hub_out_of_reach(how, hub, monkeypatch)
    cache2 = tmp_path / "cache2"
    config, tokenizer, model = from_pretrained(cache2)

    assert hub.file_requests() == 0, hub.requests
    # No file from the Hub; reachable, only the API calls transformers itself makes (it
    # resolves main once per from_pretrained, and lists the tokenizer's templates).
    asked = [p for _, p in hub.requests]
    assert all(p.startswith(f"/api/models/{REPO}") for p in asked) if how == "up" else not asked
    expected_model = transformers.AutoModelForCausalLM.from_pretrained(llama_folder)
    expected_tokenizer = transformers.AutoTokenizer.from_pretrained(llama_folder)
    names = {"_name_or_path"}
    assert {k: v for k, v in config.to_dict().items() if k not in names} == {
        k: v for k, v in expected_model.config.to_dict().items() if k not in names
    }
    assert torch.equal(logits(model, tokenizer), logits(expected_model, expected_tokenizer))
    # What landed locally is huggingface_hub's own cache: its tools accept it.
    local = cache2 / FOLDER
    assert (local / "refs" / "main").read_text() == sha
    snapshot = local / "snapshots" / sha
    assert {p.name: p.read_bytes() for p in snapshot.iterdir()} == llama


def test_a_local_cache_in_the_shared_store_fills_the_mirror(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    hooks: None,
    llama: dict[str, bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first worker's cache keeps Xet-backed files in the shared store (as every
    download of a Xet-backed repo leaves it): the mirror is filled from it all the same,
    and stock huggingface_hub serves the mirror offline."""
    hub.announce_xet = True
    sha = hub.add_repo(REPO, llama)
    cache1 = tmp_path / "cache1"
    lp_hub.original_snapshot_download(REPO, cache_dir=cache1)  # a stock download
    assert share_blobs(cache1) == 2
    hub.reset_counts()
    lp_hub.snapshot_download(REPO, cache_dir=cache1)  # nothing left to fetch: fills the mirror
    assert hub.file_requests() == 0
    mirrored = volume / "hub" / FOLDER / "snapshots" / sha
    assert {p.name: p.read_bytes() for p in mirrored.iterdir()} == llama

    hub_out_of_reach("offline", hub, monkeypatch)
    stock = lp_hub.original_snapshot_download(REPO, cache_dir=volume / "hub")
    assert {p.name: p.read_bytes() for p in Path(stock).iterdir()} == llama


@pytest.mark.parametrize("how", HOWS)
def test_a_mirror_one_commit_behind_the_hub(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    hooks: None,
    llama: dict[str, bytes],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    """Reachable, the Hub's new commit is loaded whole (config and weights) and fills the
    mirror; out of reach, the mirror's commit is loaded whole, with one warning."""
    old = hub.add_repo(REPO, llama)
    from_pretrained(tmp_path / "cache1")
    config = json.loads(llama["config.json"])
    config["rms_norm_eps"] = 1e-3
    new_files = {**llama, "config.json": json.dumps(config).encode()}
    new_files["model-00002-of-00002.safetensors"] = llama["model-00002-of-00002.safetensors"]
    new = hub.add_repo(REPO, new_files)

    new_worker()
    hub.reset_counts()
    hub_out_of_reach(how, hub, monkeypatch)
    cache2 = tmp_path / "cache2"
    with caplog.at_level(logging.WARNING):
        loaded, _, _ = from_pretrained(cache2)
    want = new if how == "up" else old
    assert (cache2 / FOLDER / "refs" / "main").read_text() == want
    assert os.listdir(cache2 / FOLDER / "snapshots") == [want]  # one commit, all files
    assert loaded.rms_norm_eps == (
        1e-3 if how == "up" else json.loads(llama["config.json"])["rms_norm_eps"]
    )
    mirrored = volume / "hub" / FOLDER
    assert (mirrored / "refs" / "main").read_text() == want
    if how == "up":
        # The mirror now holds the new commit whole: the next worker needs no file.
        assert {p.name for p in (mirrored / "snapshots" / new).iterdir()} == set(llama)
        unchanged = "model-00002-of-00002.safetensors"
        fetched = [p for m, p in hub.requests if m == "GET" and "/resolve/" in p]
        assert fetched and not any(unchanged in p for p in fetched), fetched
    else:
        pins = [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith("loaderplug") and "using the mirror's" in r.getMessage()
        ]
        assert len(pins) == 1 and old in pins[0], pins


def test_what_loaderplug_writes_is_a_cache_huggingface_hubs_tools_accept(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    hooks: None,
    llama: dict[str, bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub.announce_xet = True
    sha = hub.add_repo(REPO, llama)
    huggingface_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache1")
    share_blobs(volume / "hub")
    new_worker()
    hub.reset_counts()
    cache2 = tmp_path / "cache2"
    path = huggingface_hub.snapshot_download(REPO, cache_dir=cache2)
    assert hub.file_requests() == 0
    hub_out_of_reach("offline", hub, monkeypatch)
    stock = lp_hub.original_snapshot_download(REPO, cache_dir=cache2, local_files_only=True)
    assert stock == path
    info = huggingface_hub.scan_cache_dir(cache2)
    (repo,) = info.repos
    assert repo.repo_id == REPO and repo.size_on_disk == sum(len(d) for d in llama.values())
    (revision,) = repo.revisions
    assert revision.commit_hash == sha and revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} == set(llama)
    strategy = info.delete_revisions(sha)
    assert strategy.expected_freed_size == sum(len(d) for d in llama.values())
    strategy.execute()
    assert huggingface_hub.scan_cache_dir(cache2).repos == frozenset()


# -- the wrappers take what the originals take -----------------------------------------

WRAPPED = [
    pytest.param("snapshot_download", id="snapshot_download"),
    pytest.param("hf_hub_download", id="hf_hub_download"),
]


def _originals(name: str) -> tuple[Any, Any]:
    return getattr(lp_hub, name), getattr(lp_hub, f"original_{name}")


@pytest.mark.parametrize("name", [p.values[0] for p in WRAPPED])
def test_each_wrapper_has_its_originals_signature_and_name(name: str) -> None:
    wrapper, original = _originals(name)
    assert inspect.signature(wrapper) == inspect.signature(original)
    assert wrapper.__name__ == original.__name__ == name


def _sample(parameter: inspect.Parameter) -> object:
    """A value, not the default, for each parameter of the installed version."""
    special: dict[str, object] = {
        "repo_id": "acme/other",
        "filename": "sub/file.txt",
        "revision": "v1",
        "repo_type": "dataset",
        "allow_patterns": ["*.json"],
        "ignore_patterns": ["*.bin"],
        "max_workers": 3,
        "cache_dir": "/nonexistent/cache",
        "local_dir": "/nonexistent/local",
        "etag_timeout": 3.5,
    }
    if parameter.name in special:
        return special[parameter.name]
    default = parameter.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return default + 1
    return f"<{parameter.name}>"


@pytest.mark.parametrize("name", [p.values[0] for p in WRAPPED])
def test_every_parameter_reaches_the_original_as_given(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """For each parameter of the installed huggingface_hub, a call that sets it (a
    dry run or a forced download goes straight to the original; any other call is
    offered to the mirror first, here none) reaches the original with exactly that."""
    _, original = _originals(name)
    signature = inspect.signature(original)
    received: list[dict[str, Any]] = []

    def recording(*args: Any, **kwargs: Any) -> str:
        received.append(signature.bind(*args, **kwargs).arguments)
        return "from the original"

    recording.__signature__ = signature  # type: ignore[attr-defined]
    recording.__name__ = name
    monkeypatch.setenv("LOADERPLUG_MIRROR", str(tmp_path / "volume"))  # an empty mirror
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may reach a Hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    wrapper_ = lp_hub._wrap(recording, file_call=name == "hf_hub_download")
    required = {p.name: _sample(p) for p in signature.parameters.values() if p.default is p.empty}
    for parameter in signature.parameters.values():
        value = _sample(parameter)
        call = {"cache_dir": str(tmp_path), **required, parameter.name: value}
        received.clear()
        assert wrapper_(**call) == "from the original"
        (arguments,) = received
        assert arguments[parameter.name] == value, parameter.name


@pytest.mark.parametrize("name", [p.values[0] for p in WRAPPED])
@pytest.mark.parametrize(
    "legacy",
    [
        {"proxies": {"https": "http://proxy:3128"}},
        {"resume_download": True},
        {"force_filename": "x"},
        {"local_dir_use_symlinks": "auto"},
    ],
    ids=lambda d: next(iter(d)),
)
def test_legacy_arguments_are_tolerated_as_the_original_tolerates_them(
    name: str, legacy: dict[str, object], hub: HubServer, tmp_path: Path
) -> None:
    """transformers still passes ``proxies=``: both take it with the same warning."""
    hub.add_repo(REPO, {"config.json": b"{}"})
    wrapper, original = _originals(name)
    extra = {"filename": "config.json"} if name == "hf_hub_download" else {}
    results = []
    for function, cache in ((original, "stock"), (wrapper, "ours")):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results.append(function(REPO, cache_dir=tmp_path / cache, **extra, **legacy))
        said = [str(w.message) for w in caught if next(iter(legacy)) in str(w.message)]
        assert len(said) == 1, said
    stock, ours = results
    assert Path(ours).relative_to(tmp_path / "ours") == Path(stock).relative_to(tmp_path / "stock")


@pytest.mark.parametrize("name", [p.values[0] for p in WRAPPED])
def test_bad_calls_fail_as_the_originals_fail(name: str) -> None:
    wrapper, original = _originals(name)
    extra = {"filename": "config.json"} if name == "hf_hub_download" else {}
    for function in (wrapper, original):
        with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
            function(REPO, colour="red", **extra)
        with pytest.raises(huggingface_hub.errors.HFValidationError):
            function("bad..repo--id", **extra)


def test_install_reaches_names_imported_before_it_and_hfapi_methods() -> None:
    from huggingface_hub import _snapshot_download, file_download
    from transformers.utils import hub as transformers_hub

    assert transformers_hub.hf_hub_download is lp_hub.original_hf_hub_download
    with lp_hub.installed():
        assert transformers_hub.hf_hub_download is lp_hub.hf_hub_download
        assert file_download.hf_hub_download is lp_hub.hf_hub_download  # HfApi's import
        assert _snapshot_download.snapshot_download is lp_hub.snapshot_download
        assert huggingface_hub.hf_hub_download is lp_hub.hf_hub_download
        # The original snapshot_download fetches each file with the original.
        assert _snapshot_download.hf_hub_download is lp_hub.original_hf_hub_download
    assert transformers_hub.hf_hub_download is lp_hub.original_hf_hub_download
    assert file_download.hf_hub_download is lp_hub.original_hf_hub_download


# -- bad input stays bad input ---------------------------------------------------------


def test_an_unknown_repo_or_revision_fails_as_the_hub_says(
    hub: HubServer, tmp_path: Path, volume: Path, hooks: None
) -> None:
    hub.add_repo(REPO, {"config.json": b"{}"})
    cache = tmp_path / "cache"
    with pytest.raises(huggingface_hub.errors.RepositoryNotFoundError):
        huggingface_hub.snapshot_download("acme/nothing", cache_dir=cache)
    with pytest.raises(huggingface_hub.errors.RepositoryNotFoundError):
        huggingface_hub.hf_hub_download("acme/nothing", "config.json", cache_dir=cache)
    with pytest.raises(huggingface_hub.errors.RevisionNotFoundError):
        huggingface_hub.snapshot_download(REPO, revision="v9", cache_dir=cache)
    with pytest.raises(huggingface_hub.errors.RevisionNotFoundError):
        huggingface_hub.hf_hub_download(REPO, "config.json", revision="v9", cache_dir=cache)
    assert not (volume / "hub").exists() or not any((volume / "hub").iterdir())


def test_a_mirror_ref_naming_a_commit_it_lacks_is_no_snapshot(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    hooks: None,
    llama: dict[str, bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sha = hub.add_repo(REPO, llama)
    huggingface_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache1")
    (volume / "hub" / FOLDER / "refs" / "main").write_text("f" * 40)
    new_worker()
    hub_out_of_reach("offline", hub, monkeypatch)
    for call in (
        lambda: huggingface_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache2"),
        lambda: huggingface_hub.snapshot_download(
            REPO, cache_dir=tmp_path / "cache2", ignore_patterns="*"
        ),
        lambda: huggingface_hub.hf_hub_download(REPO, "config.json", cache_dir=tmp_path / "c2"),
    ):
        with pytest.raises(huggingface_hub.errors.LocalEntryNotFoundError):
            call()
    assert not (tmp_path / "cache2" / FOLDER / "snapshots" / sha).exists()


def only_this_file_downloaded(
    hub: HubServer,
    cache: Path,
    llama: dict[str, bytes],
    shard: str,
    caplog: pytest.LogCaptureFixture,
) -> str:
    """A fresh worker's snapshot is whole, with ``shard`` alone fetched from the Hub;
    what loaderplug said about it."""
    new_worker()
    hub.reset_counts()
    with caplog.at_level(logging.WARNING):
        path = huggingface_hub.snapshot_download(REPO, cache_dir=cache)
    assert {p.name: p.read_bytes() for p in Path(path).iterdir()} == llama
    fetched = [p for m, p in hub.requests if m == "GET" and "/resolve/" in p]
    assert len(fetched) == 1 and fetched[0].endswith(shard)
    return " ".join(r.getMessage() for r in caplog.records if r.name.startswith("loaderplug"))


@pytest.mark.parametrize("fault", ["truncated", "replaced"])
def test_a_bad_store_file_on_the_mirror_is_refused_and_downloaded(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    hooks: None,
    llama: dict[str, bytes],
    caplog: pytest.LogCaptureFixture,
    fault: str,
) -> None:
    hub.announce_xet = True
    sha = hub.add_repo(REPO, llama)
    huggingface_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache1")
    share_blobs(volume / "hub")
    shard = "model-00001-of-00002.safetensors"
    stored = (volume / "hub" / FOLDER / "snapshots" / sha / shard).resolve()
    assert stored.parent.parent.name == "blobs"  # in the shared store
    stored.chmod(0o644)
    data = stored.read_bytes()
    stored.write_bytes(data[:-1] if fault == "truncated" else bytes(len(data)))
    said = only_this_file_downloaded(hub, tmp_path / "cache2", llama, shard, caplog)
    assert shard in said and ("bytes" in said or "corrupt" in said), said


def test_a_blob_link_out_of_the_hub_root_is_refused_with_the_reason(
    hub: HubServer,
    tmp_path: Path,
    volume: Path,
    hooks: None,
    llama: dict[str, bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    sha = hub.add_repo(REPO, llama)
    huggingface_hub.snapshot_download(REPO, cache_dir=tmp_path / "cache1")
    shard = "model-00002-of-00002.safetensors"
    blob = (volume / "hub" / FOLDER / "snapshots" / sha / shard).resolve()
    outside = tmp_path / "elsewhere"
    outside.write_bytes(blob.read_bytes())
    blob.unlink()
    blob.symlink_to(os.path.relpath(outside, blob.parent))
    said = only_this_file_downloaded(hub, tmp_path / "cache2", llama, shard, caplog)
    assert "not a file of the cache's shared blob store" in said, said
