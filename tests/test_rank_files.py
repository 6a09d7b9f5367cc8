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


@pytest.mark.distributed
@pytest.mark.slow("two ranks, processes that import torch")
def test_hosts_whose_files_differ_only_in_layout_each_load_their_own(tmp_path: Path) -> None:
    """Two hosts' mirrors hold a file of one name, size and mtime but another layout
    (a transposed tensor): the hosts do not split the reads, and each rank gets its
    own file's tensors."""
    from safetensors.torch import save_file

    files = []
    for host, shape in enumerate([(256, 512), (512, 256)]):
        path = tmp_path / f"mirror{host}" / "model.safetensors"
        path.parent.mkdir()
        save_file({"w": torch.full(shape, float(host + 1))}, str(path))
        os.utime(path, ns=(1_700_000_000 * 10**9, 1_700_000_000 * 10**9))
        files.append(path)
    assert files[0].stat().st_size == files[1].stat().st_size
    per_rank = {
        rank: {
            "LOADERPLUG_HOST_ID": f"host{rank}",
            "RANK_LOCAL_DIR": str(tmp_path / f"local{rank}"),
            "RANK_FILES": str(files[rank]),
        }
        for rank in range(2)
    }
    outs, _ = run_ranks(tmp_path, files[:1], 2, {"LOADERPLUG_HOST_SPLIT": "on"}, per_rank)
    for rank, out in enumerate(outs):
        assert out.get("error") is None, out
        assert out["tensors"] == expected([files[rank]])
        assert not out["hosts"]["split"], out["hosts"]
        assert "header" in out["hosts"]["why"], out["hosts"]
