"""Mirrors with the habits of real network filesystems: inode numbers that change when the
kernel forgets an inode, stale NFS handles, whole-second mtimes, attribute caches that
lag a replacement, and the kernel dropping its dentry and inode caches (memory pressure).

Under each, every job a user runs from the mirror (hydrate, sync, the one pass, ranks
sharing a load, a Hub download) completes with byte-identical files, and a file replaced
on the mirror mid-copy is still never published.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loaderplug import hydrate, sync
from loaderplug.errors import TransferFailed
from loaderplug.testing.eviction import evicting, eviction_unavailable_reason
from loaderplug.testing.hub import HubServer
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import (
    Replace,
    VolumeProfile,
    mounted,
)
from loaderplug.units import MiB
from tests.conftest import FAST, leftover_temps, tree_bytes

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytestmark = [pytest.mark.fuse, pytest.mark.slow("a FUSE test volume per habit of a network mount")]

# Each habit alone, then all of them at once.
HABITS = {
    "node-ids": VolumeProfile(inode_numbers="node-ids"),
    "new-each-look": VolumeProfile(inode_numbers="new-each-look"),
    "stale-handles": VolumeProfile(stale_handles=0.02, seed=7),
    "whole-second-mtimes": VolumeProfile(whole_second_mtimes=True),
    "attr-lag": VolumeProfile(attr_lag_s=2.0),
    "all": VolumeProfile(
        inode_numbers="node-ids",
        stale_handles=0.01,
        whole_second_mtimes=True,
        attr_lag_s=2.0,
        seed=11,
    ),
}
# (habit, whether the kernel's dentry and inode caches are dropped every 100 ms)
CASES = [(habit, False) for habit in HABITS]
CASES += [("stable", True), ("node-ids", True), ("all", True)]
PROFILES = {"stable": VolumeProfile(), **HABITS}

REPO_ID = "acme/habits"


@contextlib.contextmanager
def maybe_evicting(evict: bool) -> Iterator[None]:
    if not evict:
        yield
        return
    reason = eviction_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with evicting(0.1) as eviction:
        yield
    assert eviction.drops > 0


def case_id(case: tuple[str, bool]) -> str:
    habit, evict = case
    return f"{habit}+eviction" if evict else habit


@pytest.fixture
def backing(tmp_path: Path, hub: HubServer) -> Path:
    """A mirror's folder: a 4-shard model, and a Hub repo as stock huggingface_hub
    leaves it when HF_HOME is on the volume."""
    from huggingface_hub import snapshot_download

    folder = tmp_path / "backing"
    write_model(folder / "model", 6 * MiB, shards=4)
    files = {p.name: p.read_bytes() for p in sorted((folder / "model").iterdir())}
    hub.add_repo(REPO_ID, files)
    snapshot_download(REPO_ID, cache_dir=folder / "hub")
    return folder


def tensors_of(files: list[Path]) -> dict[str, bytes]:
    from safetensors.torch import load_file

    return {
        name: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for f in files
        for name, t in load_file(str(f)).items()
    }


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_job_completes_with_identical_files(
    case: tuple[str, bool],
    backing: Path,
    tmp_path: Path,
    hub: HubServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    habit, evict = case
    original = tree_bytes(backing / "model")
    with (
        mounted(backing, tmp_path / "mnt", PROFILES[habit]) as vol,
        maybe_evicting(evict),
    ):
        mirror = vol.mountpoint
        hydrate_then_sync(mirror, tmp_path, original)
        one_pass(mirror / "model", tmp_path / "one-pass", backing / "model")
        ranks_share_a_one_pass(mirror / "model", tmp_path, backing / "model")
        hub_download_from_the_mirror(mirror, tmp_path, hub, monkeypatch, original)
        stats = vol.stats()
    if PROFILES[habit].stale_handles:
        assert stats["stale_handles"] > 0, stats  # the habit was exercised


def hydrate_then_sync(mirror: Path, tmp_path: Path, original: dict[str, bytes]) -> None:
    local = tmp_path / "hydrated"
    report = hydrate(mirror / "model", local, **FAST)
    assert report.ok and tree_bytes(local) == original, "hydrate"
    # A model saved just now (mtimes to the nanosecond) synced to the mirror, twice: the
    # second finds every file current there, whatever precision the mirror keeps.
    saved = tmp_path / "saved"
    saved.mkdir()
    for name, data in original.items():
        (saved / name).write_bytes(data)
    sync(saved, mirror / "synced", **FAST)
    assert tree_bytes(mirror / "synced") == original, "sync"
    again = sync(saved, mirror / "synced", **FAST)
    assert again.restored == [] and again.skipped, "the second sync copied again"
    # A hydrate of what was synced (listed by the manifest the sync wrote).
    report = hydrate(mirror / "synced", tmp_path / "from-synced", **FAST)
    assert report.ok and tree_bytes(tmp_path / "from-synced") == original, "hydrate of a sync"
    assert leftover_temps(tmp_path / "from-synced") == []


def same_weights(local: Path, backing: Path) -> bool:
    """The one pass copies the weight files it loads."""
    weights = {p.name: p.read_bytes() for p in backing.glob("*.safetensors")}
    return {name: (local / name).read_bytes() for name in weights} == weights


def one_pass(model: Path, local: Path, backing: Path) -> None:
    """``backing``: the mirror's folder behind the mount, to compare with (safetensors maps
    the files it loads, and a mapping of the mount dies of SIGBUS at a stale handle)."""
    from loaderplug.tensors.reader import iter_tensors

    files = sorted(model.glob("*.safetensors"))
    got = {
        name: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for name, t in iter_tensors(files, local_dir=local, **FAST)
    }
    assert got == tensors_of(sorted(backing.glob("*.safetensors"))), "one pass: tensors"
    assert same_weights(local, backing), "one pass: local copy"


def ranks_share_a_one_pass(model: Path, tmp_path: Path, backing: Path) -> None:
    from tests.helpers.ranks import expected, run_ranks

    files = sorted(model.glob("*.safetensors"))
    local = tmp_path / "ranks"
    outs, _ = run_ranks(tmp_path, files, 2, {"RANK_LOCAL_DIR": str(local)})
    want = expected(sorted(backing.glob("*.safetensors")))
    for rank, out in enumerate(outs):
        assert out.get("error") is None and out["tensors"] == want, ("ranks", rank, out)
    assert same_weights(local, backing), "ranks: local copy"


def hub_download_from_the_mirror(
    mirror: Path,
    tmp_path: Path,
    hub: HubServer,
    monkeypatch: pytest.MonkeyPatch,
    original: dict[str, bytes],
) -> None:
    import huggingface_hub

    from loaderplug.integrations import huggingface_hub as lp_hub
    from loaderplug.integrations.hub import commits as hub_commits

    monkeypatch.setenv("LOADERPLUG_MIRROR", str(mirror))
    monkeypatch.setenv("LOADERPLUG_FSYNC", "0")
    hub_commits.forget_pins()
    hub.reset_counts()
    with lp_hub.installed():
        # Looked up at call time, as a module imported after the hooks were installed does.
        download = huggingface_hub.snapshot_download
        folder = Path(download(REPO_ID, cache_dir=tmp_path / "hub-cache"))
    hub_commits.forget_pins()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == original, "Hub download"
    assert hub.file_requests() == 0, "the Hub was asked for files the mirror holds"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_a_file_replaced_mid_copy_is_never_published(
    case: tuple[str, bool], tmp_path: Path
) -> None:
    habit, evict = case
    backing = tmp_path / "backing"
    write_model(backing, 8 * MiB, shards=2)
    victim = max(backing.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    # New content of the same size, uploaded later: only its mtime and content differ
    # (its inode too, where the mount keeps inode numbers).
    replacement = tmp_path / "replacement"
    replacement.write_bytes(bytes(victim.stat().st_size))
    later = victim.stat().st_mtime_ns + 5_000_000_000
    os.utime(replacement, ns=(later, later))
    swap = Replace(victim.name, after_bytes=2 * MiB, with_file=str(replacement))
    profile = dataclasses.replace(PROFILES[habit], replace=(swap,))
    with mounted(backing, tmp_path / "mnt", profile) as vol, maybe_evicting(evict):
        with pytest.raises(TransferFailed) as failed:
            hydrate(vol.mountpoint, tmp_path / "local", **FAST)
        assert vol.stats()["replacements"] == 1
    report = failed.value.report
    assert [r.path for r in report.failed] == [victim.name]
    assert "changed" in str(report.failed[0].reason)
    assert not (tmp_path / "local" / victim.name).exists()
    others = {p.name for p in backing.iterdir()} - {victim.name}
    assert {p.name for p in (tmp_path / "local").iterdir() if p.name in others} == others
