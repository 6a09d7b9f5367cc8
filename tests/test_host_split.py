"""Hosts told apart, and the split of a one pass's reads between them, without
namespaces: ranks on 127.0.0.1 that LOADERPLUG_HOST_ID puts on different hosts (the
simulated hosts of tests/test_multihost.py run the same on a LAN of namespaces)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loaderplug.settings import from_env
from loaderplug.tensors.host_exchange import Exchanged
from loaderplug.tensors.host_split import _keep_going, hosts_said
from loaderplug.tensors.rank_share import RankProcess, World, torchrun_host
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


def test_auto_goes_on_splitting_only_while_the_exchange_beats_the_mirror() -> None:
    keep_going = _keep_going(from_env(host_split="auto"), 2)
    assert keep_going is not None
    assert keep_going(rates((64, 200), (64, 180)))
    assert not keep_going(rates((400, 100), (300, 120)))
    # Two hosts: the exchange carries half the model, and must beat half the mirror.
    assert keep_going(rates((100, 60), (100, 60)))
    assert not keep_going(rates((100, 45), (100, 45)))
    four = _keep_going(from_env(host_split="auto"), 4)
    assert four is not None  # four hosts: it carries 3/4
    assert four(rates((100, 80), (100, 80))) and not four(rates((100, 70), (100, 70)))
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
def test_hosts_that_see_different_files_fail_together_and_publish_nothing(
    tmp_path: Path, model: list[Path]
) -> None:
    import shutil

    other = tmp_path / "other-mirror"
    shutil.copytree(model[0].parent, other)
    with open(other / model[1].name, "ab") as f:
        f.write(b"\0" * 4096)  # another revision, as far as the sizes tell
    per_rank = two_hosts(tmp_path)
    per_rank[1]["RANK_VOLUME"] = str(other)
    files = [Path("{volume}") / f.name for f in model]
    per_rank[0]["RANK_VOLUME"] = str(model[0].parent)
    outs, _ = run_ranks(tmp_path, files, 2, {"LOADERPLUG_HOST_SPLIT": "on"}, per_rank)
    for out in outs:
        assert "not the same file on every host" in (out.get("error") or ""), out
    assert not any((tmp_path / f"local{r}" / f.name).exists() for r in range(2) for f in model)


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
