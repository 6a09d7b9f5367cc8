"""Ranks on several simulated hosts (network, UTS and mount namespaces, a FUSE mount of
the mirror and a local folder each, torchrun's variables): a one pass reads the mirror
once in all, the hosts exchanging what each read; a dead, stalled or failing host."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loaderplug.testing.faults import Fault
from loaderplug.testing.hosts import (
    HostStorage,
    SimulatedHosts,
    host_volumes,
    hosts_unavailable_reason,
)
from loaderplug.testing.volume import VolumeProfile, fuse_unavailable_reason
from loaderplug.units import MiB
from tests.helpers.ranks import HELPER, RANK_ENV, REPO, expected

UNAVAILABLE = hosts_unavailable_reason() or fuse_unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"hosts: {UNAVAILABLE}"),
    pytest.mark.distributed,
    pytest.mark.fuse,
]
PATIENCE_S = 180
SHARDS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three shards of about 2 MiB, tensors of several sizes."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("mirror")
    files = []
    for shard in range(SHARDS):
        generator = torch.Generator().manual_seed(shard)
        tensors = {
            f"layer{shard}.{j}": torch.randn(128, 1024 + 96 * j, generator=generator)
            for j in range(4)
        }
        path = folder / f"model-{shard:05d}-of-{SHARDS:05d}.safetensors"
        save_file(tensors, str(path))
        files.append(path)
    return files


def model_bytes(files: list[Path]) -> int:
    return sum(f.stat().st_size for f in files)


def start(
    hosts: SimulatedHosts,
    storages: list[HostStorage],
    files: list[Path],
    ranks_per_host: int | list[int],
    env: dict[str, str] | None = None,
    *,
    one_pass: bool = True,
) -> list[subprocess.Popen[str]]:
    """A rank of ``rank_load.py`` per torchrun slot, reading its host's mount of the
    mirror and one-passing into its host's local folder (``one_pass`` False: streaming
    tensors alone, no local copy)."""
    base = {
        **RANK_ENV,
        "LOADERPLUG_HOST_SPLIT": "on",
        **(env or {}),
    }
    argv = [sys.executable, str(HELPER), "env", "0", "0", *(f"{{volume}}/{f.name}" for f in files)]
    procs = []
    for rank_env in hosts.torchrun_environments(ranks_per_host):
        storage = storages[int(rank_env["GROUP_RANK"])]
        local = str(storage.local) if one_pass else ""
        own = {"RANK_VOLUME": str(storage.volume.mountpoint), "RANK_LOCAL_DIR": local}
        procs.append(
            storage.host.popen(
                argv,
                env={**base, **rank_env, **own},
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def results(procs: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    outs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=PATIENCE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"a rank still ran after {PATIENCE_S} s:\n{err[-3000:]}")
        said = json.loads(out) if out.strip() else {"exit": proc.returncode}
        said["stderr"] = err
        said["ended"] = time.monotonic()
        outs.append(said)
    return outs


@pytest.fixture
def two_hosts(
    tmp_path: Path, model: list[Path]
) -> Iterator[tuple[SimulatedHosts, list[HostStorage]]]:
    throttle = VolumeProfile(mount_bytes_per_s=8 * MiB)
    with (
        SimulatedHosts(2, link_mbit=1000) as hosts,
        host_volumes(hosts, model[0].parent, tmp_path / "hosts", throttle) as storages,
    ):
        yield hosts, storages


def mirror_reads(storages: list[HostStorage]) -> list[int]:
    return [s.volume.stats()["bytes_read"] for s in storages]


def assert_every_rank_got_every_tensor(outs: list[dict[str, Any]], files: list[Path]) -> None:
    want = expected(files)
    for rank, out in enumerate(outs):
        assert out.get("error") is None and "tensors" in out, (rank, out)
        assert out["tensors"] == want, f"rank {rank} got other tensors"


def assert_copies_equal(storages: list[HostStorage], files: list[Path]) -> None:
    for storage in storages:
        for f in files:
            assert (storage.local / f.name).read_bytes() == f.read_bytes(), storage.host.hostname
        assert not [
            p.name for p in storage.local.iterdir() if "partial" in p.name or "landed" in p.name
        ]


@pytest.mark.slow("up to four ranks import torch on two simulated hosts, over FUSE")
@pytest.mark.parametrize(
    "layout", [[1, 1], [2, 2], [2, 1], [1, 2]], ids=["1+1", "2+2", "2+1", "1+2"]
)
def test_hosts_read_the_mirror_once_in_all_and_every_rank_gets_every_tensor(
    two_hosts: tuple[SimulatedHosts, list[HostStorage]], model: list[Path], layout: list[int]
) -> None:
    """Hosts of equal and unequal rank counts (torchrun nodes of different sizes)."""
    hosts, storages = two_hosts
    outs = results(start(hosts, storages, model, layout))
    assert_every_rank_got_every_tensor(outs, model)
    assert_copies_equal(storages, model)
    total, each = model_bytes(model), mirror_reads(storages)
    print(f"model {total} bytes; read per mount {each}")
    # Once in all (headers and the FUSE's readahead aside), about half on each host.
    assert sum(each) <= 1.05 * total
    assert all(0.3 * total <= n <= 0.7 * total for n in each), each
    leaders = [outs[0]["hosts"], outs[layout[0]]["hosts"]]
    assert all(d["split"] and d["hosts"] == 2 for d in leaders), leaders
    assert sum(d["mirror_bytes"] for d in leaders) == total
    assert [d["received_bytes"] for d in leaders] == [
        leaders[1]["mirror_bytes"],
        leaders[0]["mirror_bytes"],
    ]
    for rank, out in enumerate(outs):  # a host's other ranks hear what its leader did
        host = 0 if rank < layout[0] else 1
        assert out["hosts"]["mirror_bytes"] == leaders[host]["mirror_bytes"], rank


@pytest.mark.slow("up to four ranks import torch on two simulated hosts, over FUSE")
@pytest.mark.parametrize("layout", [[1, 1], [2, 2], [2, 1]], ids=["1+1", "2+2", "2+1"])
def test_streaming_ranks_split_the_reads_and_get_every_tensor_as_it_arrives(
    two_hosts: tuple[SimulatedHosts, list[HostStorage]], model: list[Path], layout: list[int]
) -> None:
    """No local copy: the hosts still read the mirror once in all, and the host's other
    ranks get the leading rank's tensors (by broadcast: no copy to map)."""
    hosts, storages = two_hosts
    outs = results(start(hosts, storages, model, layout, one_pass=False))
    assert_every_rank_got_every_tensor(outs, model)
    total, each = model_bytes(model), mirror_reads(storages)
    print(f"model {total} bytes; read per mount {each}")
    assert sum(each) <= 1.05 * total
    assert all(0.3 * total <= n <= 0.7 * total for n in each), each
    assert not any(s.local.exists() and any(s.local.iterdir()) for s in storages)
    assert all(out["hosts"]["split"] for out in outs), [out["hosts"] for out in outs]
    if max(layout) > 1:
        assert {out["sharing"] for out in outs if out["sharing"]} == {"broadcast"}


@pytest.mark.slow("two ranks on two simulated hosts, a file replaced mid-load")
def test_a_file_replaced_on_one_hosts_mirror_mid_load_fails_every_host_and_publishes_nothing(
    tmp_path: Path, model: list[Path]
) -> None:
    """Never a mix of two versions: a span read from the new file is refused, whichever
    host reads it, and no copy of that file is published anywhere."""
    hosts, volumes = slow_hosts(tmp_path, model)
    with hosts, volumes as storages:
        procs = start(hosts, storages, model, 1)
        wait_for_partial(storages[0], lines=1)
        replaced = storages[1].volume.backing / model[2].name
        data = bytearray(replaced.read_bytes())
        data[-1] ^= 0xFF
        fresh = replaced.with_name(replaced.name + ".new")
        fresh.write_bytes(bytes(data))
        fresh.replace(replaced)
        outs = results(procs)
        for out in outs:
            assert "changed" in (out.get("error") or ""), out
        for storage in storages:
            assert not (storage.local / model[2].name).exists()


def wait_for_partial(storage: HostStorage, timeout_s: float = 60, lines: int = 4) -> None:
    """Until the host's exchange has written a span into some partial copy."""
    deadline = time.monotonic() + timeout_s

    def landed_lines() -> int:
        journals = [p for p in storage.local.iterdir() if p.name.endswith("-landed")]
        return sum(p.read_text().count("\n") - 1 for p in journals)

    while landed_lines() < lines:
        assert time.monotonic() < deadline, "the exchange never started"
        time.sleep(0.05)


def slow_hosts(tmp_path: Path, model: list[Path]) -> Any:
    """Two hosts whose mirrors take several seconds for the model."""
    throttle = VolumeProfile(mount_bytes_per_s=1 * MiB)
    hosts = SimulatedHosts(2, link_mbit=1000)
    return hosts, host_volumes(hosts, model[0].parent, tmp_path / "hosts", throttle)


@pytest.mark.slow("two ranks on two simulated hosts, streaming; one host killed")
@pytest.mark.crash
def test_a_host_that_dies_mid_stream_is_named_by_the_other(
    tmp_path: Path, model: list[Path]
) -> None:
    """Tensors alone (no local copy): the survivor fails within seconds, naming the
    dead host, and writes nothing."""
    hosts, volumes = slow_hosts(tmp_path, model)
    with hosts, volumes as storages:
        procs = start(hosts, storages, model, 1, one_pass=False)
        deadline = time.monotonic() + 60
        while storages[0].volume.stats()["bytes_read"] < model_bytes(model) / 8:
            assert time.monotonic() < deadline, "the exchange never started"
            time.sleep(0.05)
        lost_at = time.monotonic()
        hosts[1].kill()
        survivor = results(procs[:1])[0]
        assert "host1" in (survivor.get("error") or ""), survivor
        assert survivor["ended"] - lost_at < 20  # the heartbeat's 5 s and a step
        assert not any(storages[0].local.iterdir())


@pytest.mark.slow("two ranks on two simulated hosts; one host killed, then a rerun")
@pytest.mark.crash
@pytest.mark.parametrize(
    ("how", "lost"),
    [("killed", 1), ("stalled", 1), ("stalled", 0)],
    ids=["killed", "stalled", "store-host-stalled"],
)
def test_a_host_that_dies_or_stalls_fails_the_other_naming_it_and_a_rerun_resumes(
    tmp_path: Path, model: list[Path], how: str, lost: int
) -> None:
    """Host 0 serves the group's store: when it stalls, host 1's heartbeats go
    unanswered, which names it as well."""
    hosts, volumes = slow_hosts(tmp_path, model)
    kept = 1 - lost
    with hosts, volumes as storages:
        procs = start(hosts, storages, model, 1)
        wait_for_partial(storages[kept])
        lost_at = time.monotonic()
        if how == "stalled":
            hosts.stall(lost)  # its process lives on, and says nothing
        else:
            hosts[lost].kill()
        survivor = results(procs[kept : kept + 1])[0]
        noticed_s = survivor["ended"] - lost_at
        print(
            f"host {lost} {how}: the other failed {noticed_s:.1f} s later: {survivor.get('error')}"
        )
        assert f"host{lost}" in (survivor.get("error") or ""), survivor
        assert noticed_s < 20  # the heartbeat's 5 s and a step, not the 60 s timeout
        # Nothing partial is published; what landed is kept for the rerun.
        published = [f.name for f in model if (storages[kept].local / f.name).exists()]
        assert len(published) < len(model)
        landed_before = [p for p in storages[kept].local.iterdir() if p.name.endswith("-landed")]
        landed = sum(landed_bytes(p) for p in landed_before)
        hosts[lost].kill()
        hosts.unstall(lost)
        for storage in storages:
            storage.volume.reset_stats()
        outs = results(start(hosts, storages, model, 1))
        assert_every_rank_got_every_tensor(outs, model)
        assert_copies_equal(storages, model)
        # The rerun resumed: what landed was not read from a mirror again (a span that
        # landed on one host only is read from that host's disk, for the other).
        from_mirror = sum(out["hosts"]["mirror_bytes"] for out in outs)
        read = sum(out["hosts"]["mirror_bytes"] + out["hosts"]["disk_bytes"] for out in outs)
        assert landed > 0 and from_mirror <= model_bytes(model) - landed
        assert read <= model_bytes(model)
        assert sum(mirror_reads(storages)) <= 1.05 * model_bytes(model) - landed


def landed_bytes(journal: Path) -> int:
    """The bytes a partial copy's journal says landed (its lines after the first)."""
    lines = journal.read_text().splitlines()[1:]
    return sum(int(end) - int(begin) for begin, end in (line.split() for line in lines))


@pytest.mark.slow("two ranks on two simulated hosts, one mount failing")
@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE], ids=["EIO", "ESTALE"])
def test_a_range_one_host_cannot_read_is_read_by_the_other(
    tmp_path: Path, model: list[Path], code: int
) -> None:
    eio = Fault(code, path_glob=f"*{model[1].name}")
    profiles = [VolumeProfile(), VolumeProfile(faults=(eio,))]
    with (
        SimulatedHosts(2, link_mbit=1000) as hosts,
        host_volumes(hosts, model[0].parent, tmp_path / "hosts", profiles) as storages,
    ):
        outs = results(start(hosts, storages, model, 1, {"LOADERPLUG_RETRY_ATTEMPTS": "2"}))
        assert_every_rank_got_every_tensor(outs, model)
        assert_copies_equal(storages, model)
        assert storages[1].volume.stats()["faults_injected"] > 0
        # Host 0 read all of the file host 1 could not, and its own half of the rest.
        assert (
            outs[0]["hosts"]["mirror_bytes"] > model_bytes(model) / 2 + model[1].stat().st_size / 3
        )


@pytest.mark.slow("two ranks on two simulated hosts, twice")
@pytest.mark.parametrize(
    ("mirror", "link_mbit", "split"),
    [(1 * MiB, 1000, True), (None, 4, False)],
    ids=["slow-mirror-fast-link", "fast-mirror-slow-link"],
)
def test_auto_splits_only_when_the_exchange_beats_the_mirror(
    tmp_path: Path, model: list[Path], mirror: float | None, link_mbit: float, split: bool
) -> None:
    throttle = VolumeProfile(mount_bytes_per_s=mirror)
    with (
        SimulatedHosts(2, link_mbit=link_mbit) as hosts,
        host_volumes(hosts, model[0].parent, tmp_path / "hosts", throttle) as storages,
    ):
        outs = results(start(hosts, storages, model, 1, {"LOADERPLUG_HOST_SPLIT": "auto"}))
        assert_every_rank_got_every_tensor(outs, model)
        assert_copies_equal(storages, model)
        said = [out["hosts"] for out in outs]
        print(said)
        assert [d["split"] for d in said] == [split, split], said
        if not split:  # each host read the rest alone, nothing twice
            assert all(n <= 1.05 * model_bytes(model) for n in mirror_reads(storages))
