"""Hosts told apart, and the split of a one pass's reads between them, without
namespaces: ranks on 127.0.0.1 that LOADERPLUG_HOST_ID puts on different hosts (the
simulated hosts of tests/test_multihost.py run the same on a LAN of namespaces)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from loaderplug.settings import from_env
from loaderplug.tensors.hosts.exchange import Exchanged
from loaderplug.tensors.hosts.split import _keep_going, hosts_said
from loaderplug.tensors.ranks.world import RankProcess, World, torchrun_host
from loaderplug.units import MiB
from tests.helpers.ranks import expected, run_ranks


def process(host: str) -> RankProcess:
    return RankProcess(host, 1, None, host)


def test_hosts_are_the_ranks_grouped_by_host_in_order_of_their_first_rank() -> None:
    world = World(None, tuple(process(h) for h in "abbaca"), me=0)
    assert world.hosts() == [[0, 3, 5], [1, 2], [4]]


def test_torchrun_names_the_host_where_it_set_its_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("GROUP_RANK", raising=False)
    assert torchrun_host(tmp_path) is None
    monkeypatch.setenv("GROUP_RANK", "3")
    assert torchrun_host(tmp_path) is None  # not torchrun's without LOCAL_WORLD_SIZE
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    node = torchrun_host(tmp_path)
    assert node is not None and node.startswith("torchrun-node-3/")
    # Another local folder on the same node is another host: no copy is shared.
    assert torchrun_host(tmp_path / "other") != node
    assert RankProcess.here(from_env(), tmp_path).host == node
    assert RankProcess.here(from_env(host_id="mine"), tmp_path).host == "mine"


def rates(*pairs: tuple[float | None, float | None]) -> Exchanged:
    return Exchanged(rates=[(m and m * MiB, x and x * MiB) for m, x in pairs])


def test_auto_goes_on_splitting_only_while_the_split_is_the_faster() -> None:
    """Each host's pair: its mirror's rate alone, the pace the model reached it split."""
    keep_going = _keep_going(from_env(host_split="auto"), 2)
    assert keep_going is not None
    assert keep_going(rates((64, 120), (64, 110)))  # a slow mount, a fast link
    assert not keep_going(rates((320, 100), (300, 120)))  # a fast mount, a slow link
    # The hosts' means decide: one host's fast pace does not carry a slow one.
    assert not keep_going(rates((100, 150), (100, 40)))
    assert keep_going(rates((100, 101), (100, 101))) and not keep_going(rates((100, 99), (100, 99)))
    four = _keep_going(from_env(host_split="auto"), 4)
    assert four is not None and four(rates(*[(64, 200)] * 4))
    assert keep_going(rates((None, None), (None, None)))  # nothing measured: go on
    assert _keep_going(from_env(host_split="on"), 2) is None  # forced: never asked


def test_doctor_words_for_each_setting() -> None:
    environ = {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    assert "torchrun node 0 of ?, 2 rank(s) here" in hosts_said(from_env(), environ)
    assert "LOADERPLUG_HOST_ID" in hosts_said(from_env(host_id="h1"), environ)
    assert "forced on" in hosts_said(from_env(host_split="on"), {})


@pytest.fixture
def model(tmp_path: Path) -> list[Path]:
    import torch
    from safetensors.torch import save_file

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    files = []
    for shard in range(3):
        tensors = {f"w{shard}.{j}": torch.randn(256, 512 + 64 * j) for j in range(3)}
        files.append(mirror / f"model-{shard}.safetensors")
        save_file(tensors, str(files[-1]))
    return files


def two_hosts(tmp_path: Path, **extra: str) -> dict[int, dict[str, str]]:
    return {
        rank: {
            "LOADERPLUG_HOST_ID": f"host{rank}",
            "RANK_LOCAL_DIR": str(tmp_path / f"local{rank}"),
        }
        | extra
        for rank in range(2)
    }


@pytest.mark.distributed
def test_two_hosts_each_read_half_and_publish_whole_copies(
    tmp_path: Path, model: list[Path]
) -> None:
    outs, _ = run_ranks(tmp_path, model, 2, {"LOADERPLUG_HOST_SPLIT": "on"}, two_hosts(tmp_path))
    want = expected(model)
    total = sum(f.stat().st_size for f in model)
    for rank, out in enumerate(outs):
        assert out.get("error") is None, out
        assert out["tensors"] == want
        assert out["hosts"]["split"] and out["hosts"]["hosts"] == 2
        for f in model:
            assert (tmp_path / f"local{rank}" / f.name).read_bytes() == f.read_bytes()
    read = [out["hosts"]["mirror_bytes"] for out in outs]
    assert sum(read) == total and min(read) > total / 3
    assert [out["hosts"]["received_bytes"] for out in outs] == read[::-1]


@pytest.mark.distributed
def test_hosts_whose_mirrors_differ_do_not_split_and_each_loads_its_own(
    tmp_path: Path, model: list[Path]
) -> None:
    """Another revision on one host's mirror (same size, another mtime): the hosts do
    not exchange, each loads its own mirror's files, as it would alone."""
    import shutil

    import torch
    from safetensors.torch import save_file

    other = tmp_path / "other-mirror"
    shutil.copytree(model[0].parent, other)
    changed = {f"w1.{j}": torch.randn(256, 512 + 64 * j) for j in range(3)}
    save_file(changed, str(other / model[1].name))  # same shapes, same size
    os.utime(other / model[1].name, ns=(1, 1))
    per_rank = two_hosts(tmp_path)
    per_rank[0]["RANK_VOLUME"], per_rank[1]["RANK_VOLUME"] = str(model[0].parent), str(other)
    files = [Path("{volume}") / f.name for f in model]
    outs, _ = run_ranks(tmp_path, files, 2, {"LOADERPLUG_HOST_SPLIT": "on"}, per_rank)
    for rank, out in enumerate(outs):
        assert out.get("error") is None, out
        assert not out["hosts"]["split"] and "differs between the hosts" in out["hosts"]["why"]
        mirror = Path(per_rank[rank]["RANK_VOLUME"])
        assert out["tensors"] == expected([mirror / f.name for f in model])
    assert outs[0]["tensors"] != outs[1]["tensors"]


@pytest.mark.distributed
def test_a_local_folder_held_by_another_job_is_not_split_and_waited_for(
    tmp_path: Path, model: list[Path]
) -> None:
    """One host's folder is locked a moment by another job: the hosts do not wait in
    a collective for it; each loads alone, that host once the lock is let go."""
    from loaderplug.jobs.locks import Lock, folder_lock

    per_rank = two_hosts(tmp_path)
    held = Lock(folder_lock(Path(per_rank[1]["RANK_LOCAL_DIR"])), 5)
    held.acquire()
    # Let go once the other host published its whole copy: the hosts decided before it
    # loaded, so the lock was held when they looked, however long the ranks took to start.
    published = [Path(per_rank[0]["RANK_LOCAL_DIR"]) / f.name for f in model]
    ended = threading.Event()

    def release() -> None:
        while not ended.is_set() and not all(p.exists() for p in published):
            ended.wait(0.1)
        held.release()

    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        outs, _ = run_ranks(tmp_path, model, 2, {"LOADERPLUG_HOST_SPLIT": "on"}, per_rank)
    finally:
        ended.set()
        releaser.join()
    for out in outs:
        assert out.get("error") is None, out
        assert out["tensors"] == expected(model)
        assert not out["hosts"]["split"] and "locked by another job" in out["hosts"]["why"]


@pytest.mark.distributed
def test_off_reads_everything_on_every_host(tmp_path: Path, model: list[Path]) -> None:
    outs, _ = run_ranks(tmp_path, model, 2, {"LOADERPLUG_HOST_SPLIT": "off"}, two_hosts(tmp_path))
    for out in outs:
        assert out.get("error") is None, out
        assert out["hosts"] == {
            "hosts": 2, "split": False, "why": "LOADERPLUG_HOST_SPLIT=off",
            "mirror_bytes": None, "received_bytes": None, "disk_bytes": None,
        }  # fmt: skip
        assert sum(out["reads"].values()) >= sum(f.stat().st_size for f in model)


def hosts_of(tmp_path: Path, layout: list[int], **extra: str) -> dict[int, dict[str, str]]:
    """Per-rank settings putting ``layout[h]`` ranks on host ``h``, in rank order."""
    per_rank, rank = {}, 0
    for host, ranks in enumerate(layout):
        for _ in range(ranks):
            per_rank[rank] = {
                "LOADERPLUG_HOST_ID": f"host{host}",
                "RANK_LOCAL_DIR": str(tmp_path / f"local{host}"),
            } | extra
            rank += 1
    return per_rank


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout", [[2, 1], [1, 2], [3, 1], [2, 2, 1]], ids=["2+1", "1+2", "3+1", "2+2+1"]
)
def test_hosts_with_unequal_rank_counts_split_and_every_rank_gets_every_tensor(
    tmp_path: Path, model: list[Path], layout: list[int]
) -> None:
    """A host of two ranks and one of one: every group the load makes gets the same
    name on each of its members, so no leader waits for a group the other never joins."""
    per_rank = hosts_of(tmp_path, layout)
    outs, _ = run_ranks(tmp_path, model, sum(layout), {"LOADERPLUG_HOST_SPLIT": "on"}, per_rank)
    total = sum(f.stat().st_size for f in model)
    for out in outs:
        assert out.get("error") is None, out
        assert out["tensors"] == expected(model)
        assert out["hosts"]["split"] and out["hosts"]["hosts"] == len(layout)
    for host in range(len(layout)):
        for f in model:
            assert (tmp_path / f"local{host}" / f.name).read_bytes() == f.read_bytes()
    mirror = sum(sum(b for p, b in out["read_paths"].items() if "mirror" in p) for out in outs)
    assert total <= mirror <= 1.05 * total


@pytest.mark.distributed
def test_hosts_passing_the_files_in_another_order_split_by_name(
    tmp_path: Path, model: list[Path]
) -> None:
    per_rank = two_hosts(tmp_path)
    per_rank[1]["RANK_FILES"] = os.pathsep.join(str(f) for f in reversed(model))
    outs, _ = run_ranks(tmp_path, model, 2, {"LOADERPLUG_HOST_SPLIT": "on"}, per_rank)
    total = sum(f.stat().st_size for f in model)
    for rank, out in enumerate(outs):
        assert out.get("error") is None, out
        assert out["tensors"] == expected(model)
        assert out["hosts"]["split"]
        for f in model:
            assert (tmp_path / f"local{rank}" / f.name).read_bytes() == f.read_bytes()
    assert sum(out["hosts"]["mirror_bytes"] for out in outs) == total


@pytest.mark.distributed
def test_ranks_of_one_host_passing_the_files_in_another_order_share_them_by_name(
    tmp_path: Path, model: list[Path]
) -> None:
    per_rank = {1: {"RANK_FILES": os.pathsep.join(str(f) for f in reversed(model))}}
    outs, _ = run_ranks(tmp_path, model, 2, {}, per_rank)
    for out in outs:
        assert out.get("error") is None, out
        assert out["tensors"] == expected(model)
    # The ranks agree who reads which file (by position, each would own another).
    assert outs[0]["owners"] == outs[1]["owners"]
    assert sorted(outs[0]["owners"]) == sorted(str(f) for f in model)
    assert set(outs[0]["owners"].values()) == {0, 1}


@pytest.mark.distributed
@pytest.mark.parametrize("split", ["on", "off"])
def test_ranks_passing_different_files_fail_on_every_host_with_the_same_cause(
    tmp_path: Path, model: list[Path], split: str
) -> None:
    per_rank = two_hosts(tmp_path) if split == "on" else {}
    per_rank.setdefault(1, {})["RANK_FILES"] = os.pathsep.join(str(f) for f in model[:2])
    outs, _ = run_ranks(tmp_path, model, 2, {"LOADERPLUG_HOST_SPLIT": split}, per_rank)
    errors = [out.get("error") or "" for out in outs]
    for error in errors:
        assert model[2].name in error and "rank 1" in error, errors
    assert errors[0] == errors[1]
    for rank in range(2):  # nothing published
        assert not (tmp_path / f"local{rank}" / model[0].name).exists()


@pytest.mark.distributed
def test_a_host_whose_load_stops_early_leaves_the_others_loading_alone(
    tmp_path: Path, model: list[Path]
) -> None:
    """A caller on one host closes its load after a tensor: the other host is not
    failed for it; it reads the rest from its own mirror and gets every tensor."""
    per_rank = hosts_of(tmp_path, [1, 1])
    per_rank[1]["RANK_STOP_AFTER"] = "1"
    # Host 0 takes its tensors slowly and holds little, so the exchange, which goes at
    # its pace, is mid-way when host 1 stops.
    per_rank[0]["RANK_TENSOR_SLEEP_S"] = "0.1"
    env = {"LOADERPLUG_HOST_SPLIT": "on", "LOADERPLUG_BYTES_IN_FLIGHT": "4M"}
    outs, _ = run_ranks(tmp_path, model, 2, env, per_rank)
    assert outs[1].get("error") is None and len(outs[1]["tensors"]) == 1, outs[1]
    assert outs[0].get("error") is None, outs[0]
    assert outs[0]["tensors"] == expected(model)
    for f in model:
        assert (tmp_path / "local0" / f.name).read_bytes() == f.read_bytes()
    assert "host #1's load ended before the exchange did" in outs[0]["hosts"]["why"]
