"""Hydrate and sync of whole trees: symlinks, refusals, the manifest, a HF cache layout."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from loaderplug import MirrorError, hydrate, sync
from loaderplug.jobs.model_folder import MANIFEST_NAME
from loaderplug.testing.model import write_model
from tests.conftest import FAST, leftover_temps, tree_bytes


def make_hf_cache(root: Path) -> Path:
    """A Hugging Face hub cache for one repo: blobs, relative snapshot links, refs."""
    repo = root / "models--acme--tiny"
    revision = "0123456789abcdef0123456789abcdef01234567"
    write_model(repo / "staging", 1 << 20, shards=2)
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted((repo / "staging").iterdir())):
        blob = f"{i:064x}"
        f.rename(repo / "blobs" / blob)
        (snapshot / f.name).symlink_to(f"../../blobs/{blob}")
    (repo / "staging").rmdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (root / ".locks" / "models--acme--tiny").mkdir(parents=True)
    return snapshot


def test_hf_cache_tree_round_trips(tmp_path: Path) -> None:
    snapshot = make_hf_cache(tmp_path / "mirror")
    report = hydrate(tmp_path / "mirror", tmp_path / "local", **FAST)
    local_snapshot = tmp_path / "local" / snapshot.relative_to(tmp_path / "mirror")
    for link in snapshot.iterdir():
        copy = local_snapshot / link.name
        assert copy.is_symlink() and os.readlink(copy) == os.readlink(link)
        assert copy.read_bytes() == link.read_bytes()  # resolves inside the local tree
    assert (tmp_path / "local/models--acme--tiny/refs/main").read_text() == snapshot.name
    assert (tmp_path / "local/.locks/models--acme--tiny").is_dir()
    assert len(report.linked) == 4 and report.ok
    again = hydrate(tmp_path / "mirror", tmp_path / "local", **FAST)
    assert again.bytes_copied == 0 and len(again.skipped) == len(report.results)


def test_escaping_symlinks_and_special_files_are_refused_and_reported(
    model: Path, tmp_path: Path
) -> None:
    (model / "abs").symlink_to("/etc/passwd")
    (model / "up").symlink_to("../outside")
    (model / "inside").symlink_to("config.json")
    os.mkfifo(model / "pipe")
    report = hydrate(model, tmp_path / "local", check=False, **FAST)
    failed = {r.path: r.reason for r in report.failed}
    assert set(failed) == {"abs", "up", "pipe"}
    assert "absolute path" in failed["abs"] and "escapes the tree" in failed["up"]
    assert "special file" in failed["pipe"]
    local = tmp_path / "local"
    assert not (local / "abs").exists() and not (local / "up").is_symlink()
    assert not (local / "pipe").exists()
    assert os.readlink(local / "inside") == "config.json"
    assert tree_bytes(local) == tree_bytes(model)


def test_sync_copies_then_writes_the_manifest_last(model: Path, tmp_path: Path) -> None:
    (model / "latest").symlink_to("config.json")
    mirror = tmp_path / "volume" / "m"
    report = sync(model, mirror, **FAST)
    assert report.ok and tree_bytes(mirror) == tree_bytes(model)
    manifest = json.loads((mirror / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == set(tree_bytes(model))
    assert manifest["symlinks"] == {"latest": "config.json"}
    for rel, entry in manifest["files"].items():
        st = (model / rel).stat()
        assert entry == {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    assert leftover_temps(mirror) == []
    # The manifest is not model content: a hydrate from the mirror does not copy it.
    hydrate(mirror, tmp_path / "local", **FAST)
    assert not (tmp_path / "local" / MANIFEST_NAME).exists()
    assert tree_bytes(tmp_path / "local") == tree_bytes(model)


def test_hydrate_refuses_files_whose_size_disagrees_with_the_manifest(
    model: Path, tmp_path: Path
) -> None:
    mirror = tmp_path / "mirror2"
    sync(model, mirror, **FAST)
    shard = "model-00002-of-00004.safetensors"
    # A sync under way (or a truncated upload): the mirror file is shorter than listed.
    os.truncate(mirror / shard, 1000)
    report = hydrate(mirror, tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == [shard]
    assert "changed since the mirror's manifest was written" in report.failed[0].reason
    assert not (tmp_path / "local" / shard).exists()
    assert len(report.restored) == 5


def test_files_missing_from_the_manifest_are_not_hydrated(model: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror2"
    sync(model, mirror, **FAST)
    (mirror / "landed-later.bin").write_bytes(b"x" * 100)
    hydrate(mirror, tmp_path / "local", **FAST)
    assert not (tmp_path / "local" / "landed-later.bin").exists()


@pytest.mark.parametrize("bad", ["/etc/passwd", "../escape.bin", "a/../../b", "a/./b"])
def test_manifest_paths_that_escape_are_refused(model: Path, tmp_path: Path, bad: str) -> None:
    mirror = tmp_path / "mirror2"
    sync(model, mirror, **FAST)
    manifest = json.loads((mirror / MANIFEST_NAME).read_text())
    manifest["files"][bad] = {"size": 5, "mtime_ns": 0}
    (mirror / MANIFEST_NAME).write_text(json.dumps(manifest))
    report = hydrate(mirror, tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == [bad]
    assert "refused" in report.failed[0].reason
    assert not (tmp_path / "escape.bin").exists()
    assert len(report.restored) == 6


def test_malformed_manifest_is_a_clear_error(model: Path, tmp_path: Path) -> None:
    (model / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(MirrorError, match=r"is malformed .* run `loaderplug sync` again"):
        hydrate(model, tmp_path / "local", **FAST)


def test_missing_source_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(MirrorError, match="is not a folder"):
        hydrate(tmp_path / "nope", tmp_path / "local")


def test_sync_skips_what_the_mirror_already_has(model: Path, tmp_path: Path) -> None:
    sync(model, tmp_path / "m", **FAST)
    again = sync(model, tmp_path / "m", **FAST)
    assert again.bytes_copied == 0 and not again.restored


@pytest.mark.parametrize("where", ["same", "inside", "around"])
def test_overlapping_source_and_destination_are_refused(
    model: Path, tmp_path: Path, where: str
) -> None:
    dst = {"same": model, "inside": model / "copy", "around": tmp_path}[where]
    with pytest.raises(MirrorError, match="overlap"):
        hydrate(model, dst)


def test_a_failed_sync_is_reported_by_the_next_hydrate(model: Path, tmp_path: Path, inject) -> None:
    shard = "model-00002-of-00004.safetensors"
    inject(errno.EACCES, match=shard)
    synced = sync(model, tmp_path / "m", check=False, **FAST)
    assert [r.path for r in synced.failed] == [shard]
    manifest = json.loads((tmp_path / "m" / MANIFEST_NAME).read_text())
    assert shard in manifest["incomplete"] and shard not in manifest["files"]
    report = hydrate(tmp_path / "m", tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == [shard]
    assert "the last sync of this file to the mirror failed" in report.failed[0].reason


def test_a_same_size_file_replaced_after_sync_is_refused(model: Path, tmp_path: Path) -> None:
    sync(model, tmp_path / "m", **FAST)
    shard = tmp_path / "m" / "model-00003-of-00004.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # a new checkpoint of the same size, written in place
    shard.write_bytes(bytes(data))
    report = hydrate(tmp_path / "m", tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == [shard.name]
    assert not (tmp_path / "local" / shard.name).exists()


def test_a_manifest_path_through_a_symlinked_folder_is_refused(model: Path, tmp_path: Path) -> None:
    sync(model, tmp_path / "m", **FAST)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("not part of the model")
    (tmp_path / "m" / "d").symlink_to(outside)
    manifest = json.loads((tmp_path / "m" / MANIFEST_NAME).read_text())
    st = (outside / "secret").stat()
    manifest["files"]["d/secret"] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    (tmp_path / "m" / MANIFEST_NAME).write_text(json.dumps(manifest))
    report = hydrate(tmp_path / "m", tmp_path / "local", check=False, **FAST)
    assert [r.path for r in report.failed] == ["d/secret"]
    assert "outside the mirror root" in report.failed[0].reason
    assert not (tmp_path / "local" / "d" / "secret").exists()


def test_a_symlink_whose_target_failed_is_not_placed(model: Path, tmp_path: Path, inject) -> None:
    (model / "latest").symlink_to("model-00001-of-00004.safetensors")
    inject(errno.EACCES, match="00001")
    report = hydrate(model, tmp_path / "local", check=False, **FAST)
    failed = {r.path: r.reason for r in report.failed}
    assert set(failed) == {"model-00001-of-00004.safetensors", "latest"}
    assert "its target model-00001-of-00004.safetensors failed" in failed["latest"]
    assert not (tmp_path / "local" / "latest").is_symlink()


def test_a_file_where_the_mirror_has_a_folder_fails_that_path_only(
    model: Path, tmp_path: Path
) -> None:
    (model / "sub").mkdir()
    (model / "sub" / "x.bin").write_bytes(b"x" * 10)
    local = tmp_path / "local"
    local.mkdir()
    (local / "sub").write_text("a file in the way")
    report = hydrate(model, local, check=False, **FAST)
    assert {r.path for r in report.failed} == {"sub", "sub/x.bin"}
    assert "cannot create the folder" in {r.path: r.reason for r in report.failed}["sub"]
    assert len(report.restored) == 6


def test_a_selection_never_reaches_outside_its_roots(model: Path, tmp_path: Path) -> None:
    from loaderplug.jobs.copies import select
    from loaderplug.settings import from_env

    first = sorted(p.name for p in model.iterdir() if p.is_file())[0]
    dst = tmp_path / "dst"
    files = {"../outside": first, "inside": "../" + first, "fine": first}
    links = {"link": "../../etc/passwd", "../link": "fine"}
    report = select("hydrate", model, dst, files, links, from_env(**FAST))
    assert sorted(r.path for r in report.failed) == ["../link", "../outside", "inside", "link"]
    assert (dst / "fine").read_bytes() == (model / first).read_bytes()
    assert not (tmp_path / "outside").exists() and not (tmp_path / "link").exists()


def test_a_link_to_a_file_the_selection_refused_is_not_made(model: Path, tmp_path: Path) -> None:
    from loaderplug.jobs.copies import select
    from loaderplug.settings import from_env

    dst = tmp_path / "dst"
    report = select(
        "hydrate", model, dst, {"gone": "no-such-file"}, {"link": "gone"}, from_env(**FAST)
    )
    assert sorted(r.path for r in report.failed) == ["gone", "link"]
    assert not (dst / "link").is_symlink()


def test_a_selection_sweeps_only_its_own_leftovers(model: Path, tmp_path: Path) -> None:
    from loaderplug.jobs.copies import select
    from loaderplug.settings import from_env

    first = sorted(p.name for p in model.iterdir() if p.is_file())[0]
    dst = tmp_path / "dst"
    (dst / "other").mkdir(parents=True)
    mine = dst / f".{first}.0123456789ab.loaderplug-tmp"
    theirs = dst / "other" / ".x.0123456789ab.loaderplug-tmp"
    mine.write_text("left by a killed run")
    theirs.write_text("another job's, under its own lock")
    select("hydrate", model, dst, {first: first}, {}, from_env(**FAST))
    assert not mine.exists() and theirs.exists()
