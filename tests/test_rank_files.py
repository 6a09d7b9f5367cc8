"""Ranks (and hosts) given different files under one name: an actor and a reward model
in one job, both ``model-00001-of-00002.safetensors``. They never get each other's
tensors: the load fails on every rank, saying which rank holds which file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.ranks import expected, run_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")


def _model(folder: Path, value: float, rows: int) -> list[Path]:
    """Two shards named as the Hub names them, every tensor filled with ``value``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    files = []
    for shard in range(2):
        path = folder / f"model-{shard + 1:05d}-of-00002.safetensors"
        tensors = {f"layer{shard}.{j}": torch.full((rows, 512), value) for j in range(3)}
        save_file(tensors, str(path))
        files.append(path)
    return files


@pytest.mark.distributed
@pytest.mark.slow("two ranks, processes that import torch")
@pytest.mark.parametrize("sizes", ["same", "different"])
@pytest.mark.parametrize("sharing", ["pagecache", "broadcast"])
def test_ranks_given_different_files_under_one_name_fail_naming_them(
    tmp_path: Path, sizes: str, sharing: str
) -> None:
    actor = _model(tmp_path / "actor", 1.0, 256)
    reward = _model(tmp_path / "reward", 2.0, 256 if sizes == "same" else 384)
    per_rank = {1: {"RANK_FILES": os.pathsep.join(map(str, reward))}}
    outs, _ = run_ranks(
        tmp_path, actor, 2, {"LOADERPLUG_RANK_SHARING": sharing}, per_rank, timeout_s=120
    )
    errors = [out.get("error") or "" for out in outs]
    for out, error in zip(outs, errors, strict=True):
        assert "tensors" not in out or out["tensors"] != expected(reward), out
        assert "must load the same files" in error and "rank 1" in error, errors
        assert actor[0].name in error, errors
    assert errors[0] == errors[1]


@pytest.mark.distributed
@pytest.mark.slow("two ranks, processes that import torch")
def test_ranks_given_the_same_file_by_two_paths_share_it(tmp_path: Path) -> None:
    """The same file (one inode) reached through a link is the same file."""
    actor = _model(tmp_path / "actor", 1.0, 256)
    linked = tmp_path / "linked"
    linked.symlink_to(tmp_path / "actor")
    per_rank = {1: {"RANK_FILES": os.pathsep.join(str(linked / f.name) for f in actor)}}
    outs, _ = run_ranks(tmp_path, actor, 2, {}, per_rank)
    for out in outs:
        assert out.get("error") is None, out
        assert out["tensors"] == expected(actor)
    assert set(outs[0]["owners"].values()) == {0, 1}
