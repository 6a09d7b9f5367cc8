"""Ranks of a gloo group sharing a load, in real processes: every rank gets every tensor,
each file is read by one rank, failures reach every rank in time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loaderplug import hydrate
from loaderplug.tensors.format.read import read_header_of
from loaderplug.tensors.ranks.mode import owners, sharing_mode
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import VolumeProfile, mounted
from loaderplug.units import MiB
from tests.conftest import drop_from_page_cache, leftover_temps
from tests.helpers.ranks import expected, run_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.distributed


@pytest.fixture
def model8(tmp_path: Path) -> list[Path]:
    """An 8 MiB model of 5 shards (uneven sizes): enough to split between 4 ranks."""
    folder = tmp_path / "model"
    write_model(folder, 8 * MiB, shards=5)
    return sorted(folder.glob("*.safetensors"))


def test_files_are_split_by_bytes_the_same_way_everywhere() -> None:
    assert owners([10, 10, 10, 10], 2) == [0, 1, 0, 1]
    assert owners([100, 1, 1, 1, 60], 2) == [0, 1, 1, 1, 1]
    split = owners([5, 9, 3, 7, 7, 1], 3)
    loads = [
        sum(s for s, r in zip([5, 9, 3, 7, 7, 1], split, strict=True) if r == k) for k in range(3)
    ]
    assert max(loads) - min(loads) <= 2


@pytest.mark.slow("a FUSE test volume")
def test_auto_shares_through_the_page_cache_but_where_a_stream_or_broadcast_is_faster(
    tmp_path: Path,
) -> None:
    from loaderplug.settings import from_env

    backing = tmp_path / "backing"
    write_model(backing, 1 * MiB, shards=1)
    (on_disk,) = sorted(backing.glob("*.safetensors"))
    local = tmp_path / "local"
    auto, streamed = from_env(progress=False), from_env(rank_sharing="stream", progress=False)
    with mounted(backing, tmp_path / "mnt", VolumeProfile.unthrottled()) as vol:
        on_mirror = vol.mountpoint / on_disk.name
        # A one pass from the mirror streams each tensor as it lands.
        assert sharing_mode([on_mirror], "cpu", local, auto) == "stream"
        # Network files read in place: mapped, their pages would be read again.
        assert sharing_mode([on_mirror], "cpu", None, auto) == "broadcast"
        # Forced to map a network file, which another machine may truncate: refused.
        with pytest.warns(UserWarning, match="LOADERPLUG_RANK_SHARING=stream is not used"):
            assert sharing_mode([on_mirror], "cpu", None, streamed) == "broadcast"
        # The copy it maps in a one pass is local: as forced.
        assert sharing_mode([on_mirror], "cpu", local, streamed) == "stream"
        # Once the local copy is current it is read instead: local files, the page cache.
        hydrate(vol.mountpoint, local, progress=False)
        assert sharing_mode([on_mirror], "cpu", local, auto) == "pagecache"
    # Local files read in place: mapped where they are loaderplug's own copies.
    own = from_env(progress=False, local_copies=str(tmp_path))
    assert sharing_mode([on_disk], "cpu", None, own) == "pagecache"
    assert sharing_mode([on_disk], "cuda", None, own) == "broadcast"
    # A user's folder may be truncated under a mapping by another process: broadcast.
    assert sharing_mode([on_disk], "cpu", None, auto) == "broadcast"
    forced = from_env(progress=False, rank_sharing="pagecache")
    with pytest.warns(UserWarning, match="not one of loaderplug's own copies"):
        assert sharing_mode([on_disk], "cpu", None, forced) == "broadcast"


@pytest.mark.slow("ranks in processes of their own, each importing torch")
@pytest.mark.parametrize("sharing", ["pagecache", "broadcast", "stream"])
@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_every_tensor_and_each_file_is_read_once(
    tmp_path: Path, model8: list[Path], world: int, sharing: str
) -> None:
    outs, _ = run_ranks(tmp_path, model8, world, {"LOADERPLUG_RANK_SHARING": sharing})
    want = expected(model8)
    for rank, out in enumerate(outs):
        assert out.get("error") is None, (rank, out)
        assert out["tensors"] == want, f"rank {rank} got other tensors"
        assert out["sharing"] == sharing
    readers: dict[str, list[int]] = {}
    for rank, out in enumerate(outs):
        for name, nbytes in out["reads"].items():
            readers.setdefault(name, []).append(rank)
            assert nbytes <= os.path.getsize(model8[0].parent / name) + 256 * 1024
    # Each file read by exactly one rank (header included), and the shares cover the job.
    assert sorted(readers) == sorted(f.name for f in model8)
    assert all(len(ranks) == 1 for ranks in readers.values()), readers
    assert len({r for ranks in readers.values() for r in ranks}) == world


@pytest.mark.slow("ranks in processes of their own, each importing torch")
@pytest.mark.parametrize("sharing", ["auto", "stream"])
def test_a_one_pass_shared_by_ranks_leaves_one_identical_local_copy(
    tmp_path: Path, model8: list[Path], sharing: str
) -> None:
    local = tmp_path / "local"
    env = {"RANK_LOCAL_DIR": str(local), "LOADERPLUG_RANK_SHARING": sharing}
    outs, _ = run_ranks(tmp_path, model8, 2, env)
    want = expected(model8)
    assert all(out.get("error") is None and out["tensors"] == want for out in outs), outs
    assert {f.name: (local / f.name).read_bytes() for f in model8} == {
        f.name: f.read_bytes() for f in model8
    }
    assert leftover_temps(local) == []
    # A later start finds the copy current: the mirror is not read again.
    outs, _ = run_ranks(tmp_path, model8, 2, env)
    assert all(out["tensors"] == want for out in outs)
    assert all(set(out["reads"]) <= {f.name for f in model8} for out in outs)


@pytest.mark.slow("ranks in processes of their own, each importing torch")
@pytest.mark.parametrize("world", [2, 3])
def test_a_streamed_one_pass_leaves_its_copy_on_disk_not_in_memory(
    tmp_path: Path, world: int
) -> None:
    """The copy's pages leave the page cache as the ranks are done with each tensor: the
    host does not end up holding the whole model in memory (the page cache, which
    leaves the pages there, shows the measure can tell)."""
    from loaderplug.storage.mounts import filesystem_type
    from loaderplug.storage.residency import cached_fraction

    if filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a file in memory has no page cache to leave")
    backing = tmp_path / "backing"
    write_model(backing, 16 * MiB, shards=4, tensors_per_shard=16)
    files = sorted(backing.glob("*.safetensors"))
    want = expected(files)
    cached = {}
    for sharing in ("stream", "pagecache"):
        local = tmp_path / f"local-{sharing}"
        # Durable spans, as by default: a dirty page cannot be dropped.
        env = {"RANK_LOCAL_DIR": str(local), "LOADERPLUG_RANK_SHARING": sharing}
        outs, _ = run_ranks(tmp_path, files, world, {**env, "LOADERPLUG_FSYNC": "1"})
        assert all(out.get("error") is None and out["tensors"] == want for out in outs), outs
        fractions = [cached_fraction(str(local / f.name)) for f in files]
        if None in fractions:
            pytest.skip("the kernel does not say what is in the page cache")
        # Of the whole copy; a consumer may still map its last tensors as the load ends.
        cached[sharing] = sum(f for f in fractions if f is not None) / len(files)
        # (Read after measuring: reading puts the copy in the page cache.)
        assert all((local / f.name).read_bytes() == f.read_bytes() for f in files)
    assert cached["stream"] < 0.1, cached
    assert cached["pagecache"] > 0.5, cached


@pytest.mark.slow("ranks in processes of their own, each importing torch")
def test_a_streaming_rank_with_nothing_landed_yet_does_not_hold_back_the_others(
    tmp_path: Path, model8: list[Path]
) -> None:
    """Rank 1's reads land late: rank 0's tensors reach both ranks meanwhile, all of
    them before any of rank 1's, instead of one of each per step (which would have every
    rank wait for rank 1's first tensor)."""
    local = tmp_path / "local"
    env = {"RANK_LOCAL_DIR": str(local), "LOADERPLUG_RANK_SHARING": "stream"}
    outs, _ = run_ranks(tmp_path, model8, 2, env, per_rank={1: {"RANK_DATA_DELAY_S": "2"}})
    assert all(out.get("error") is None and out["tensors"] == expected(model8) for out in outs)
    file_of = {t.name: f.name for f in model8 for t in read_header_of(f).tensors}
    rank0_files = set(outs[0]["reads"])
    assert rank0_files and not rank0_files & set(outs[1]["reads"])
    for out in outs:
        order = [file_of[name] in rank0_files for name in out["tensors"]]  # as received
        assert order == sorted(order, reverse=True), order
    # Rank 1's load reports when its consumer had a tensor, not when its own landed.
    assert outs[1]["first_tensor_s"] < 2, outs[1]["first_tensor_s"]


@pytest.mark.slow("ranks in processes of their own, each importing torch")
@pytest.mark.fuse
@pytest.mark.parametrize("sharing", ["auto", "stream"])
def test_a_one_pass_from_the_mirror_reads_the_volume_once_across_ranks(
    tmp_path: Path, sharing: str
) -> None:
    backing = tmp_path / "backing"
    write_model(backing, 8 * MiB, shards=4)
    local = tmp_path / "local"
    with mounted(backing, tmp_path / "mnt", VolumeProfile.unthrottled()) as vol:
        files = sorted(vol.mountpoint.glob("*.safetensors"))
        vol.reset_stats()
        env = {"RANK_LOCAL_DIR": str(local), "LOADERPLUG_RANK_SHARING": sharing}
        outs, _ = run_ranks(tmp_path, files, 2, env)
        served = vol.stats()
    want = expected(sorted(backing.glob("*.safetensors")))
    assert all(out.get("error") is None and out["tensors"] == want for out in outs), outs
    assert all(out["sharing"] == "stream" for out in outs)  # auto's choice here
    model_bytes = sum(f.stat().st_size for f in backing.glob("*.safetensors"))
    assert served["bytes_read"] <= 1.05 * model_bytes, (served, model_bytes)
    assert all(
        (local / f.name).read_bytes() == f.read_bytes() for f in backing.glob("*.safetensors")
    )


@pytest.mark.slow("ranks in processes of their own, each importing torch")
def test_a_read_that_fails_on_one_rank_fails_every_rank_naming_it(
    tmp_path: Path, model8: list[Path]
) -> None:
    split = owners([f.stat().st_size for f in model8], 2)
    victim = next(f for f, r in zip(model8, split, strict=True) if r == 1)
    outs, took = run_ranks(
        tmp_path,
        model8,
        2,
        {"LOADERPLUG_DISTRIBUTED_TIMEOUT_S": "20"},
        per_rank={1: {"RANK_FAIL": victim.name}},
    )
    # Rank 1 raises its own error; rank 0 one that names rank 1 and the cause.
    assert outs[0]["error"].startswith("DistributedError: rank 1 of the shared load failed")
    assert outs[1]["error"].startswith("FileError: "), outs[1]["error"]  # its own type
    for out in outs:
        assert victim.name in out["error"] and "Permission denied" in out["error"], out
    assert took < 60


@pytest.mark.slow("ranks in processes of their own, each importing torch")
def test_a_rank_killed_mid_load_makes_the_others_fail_within_the_timeout(
    tmp_path: Path, model8: list[Path]
) -> None:
    outs, took = run_ranks(
        tmp_path,
        model8,
        2,
        {"LOADERPLUG_DISTRIBUTED_TIMEOUT_S": "10"},
        per_rank={1: {"RANK_DIE_AFTER": "1"}},
    )
    assert outs[1].get("exit") == 9
    assert outs[0]["error"] is not None and "DistributedError" in outs[0]["error"], outs[0]
    assert took < 50


@pytest.mark.slow("ranks in processes of their own, each importing torch")
def test_distributed_off_has_every_rank_read_everything(tmp_path: Path, model8: list[Path]) -> None:
    outs, _ = run_ranks(tmp_path, model8, 2, {"LOADERPLUG_DISTRIBUTED": "off"})
    want = expected(model8)
    for out in outs:
        assert out["tensors"] == want and out["sharing"] is None
        assert sorted(out["reads"]) == sorted(f.name for f in model8)


@pytest.mark.slow("ranks in processes of their own, each importing torch")
def test_the_initialised_default_group_is_found_and_a_group_of_one_is_no_group(
    tmp_path: Path, model8: list[Path]
) -> None:
    want = expected(model8)
    outs, _ = run_ranks(tmp_path, model8, 2, {"RANK_GROUP": "none"})
    assert all(out["tensors"] == want and out["sharing"] == "pagecache" for out in outs)
    outs, _ = run_ranks(tmp_path, model8, 1)
    assert outs[0]["tensors"] == want and outs[0]["sharing"] is None
    assert sorted(outs[0]["reads"]) == sorted(f.name for f in model8)


@pytest.mark.slow("ranks in processes of their own, each importing torch")
@pytest.mark.parametrize("sharing", ["pagecache", "broadcast", "stream"])
def test_two_hosts_each_read_the_model_once_and_keep_their_own_copy(
    tmp_path: Path, model8: list[Path], sharing: str
) -> None:
    """Two groups of two ranks, told apart by LOADERPLUG_HOST_ID, in one world of four,
    the hosts' split off (tests/test_multihost.py has it on): each host reads every byte
    of the mirror once, between its two ranks, and publishes its own local copy (a one
    pass); the other host's copy is never read."""
    hosts = {rank: "host-a" if rank < 2 else "host-b" for rank in range(4)}
    per_rank = {
        rank: {"LOADERPLUG_HOST_ID": host, "RANK_LOCAL_DIR": str(tmp_path / host)}
        for rank, host in hosts.items()
    }
    settings = {"LOADERPLUG_RANK_SHARING": sharing, "LOADERPLUG_HOST_SPLIT": "off"}
    outs, _ = run_ranks(tmp_path, model8, 4, settings, per_rank)
    want = expected(model8)
    model_bytes = sum(f.stat().st_size for f in model8)
    for host in ("host-a", "host-b"):
        ranks = [r for r, h in hosts.items() if h == host]
        for rank in ranks:
            out = outs[rank]
            assert out.get("error") is None and out["tensors"] == want, (rank, out)
            others = [p for p in out["read_paths"] if "host-" in p and host not in p]
            assert not others, f"rank {rank} read the other host's copy: {others}"
        from_mirror = sum(
            n
            for r in ranks
            for p, n in outs[r]["read_paths"].items()
            if p.startswith(str(model8[0].parent))
        )
        assert model_bytes <= from_mirror <= 1.05 * model_bytes, (host, from_mirror, model_bytes)
        for f in model8:
            assert (tmp_path / host / f.name).read_bytes() == f.read_bytes()


@pytest.mark.slow("ranks in processes of their own, each importing torch")
@pytest.mark.parametrize("sharing", ["pagecache", "stream"])
def test_ranks_mapping_each_others_files_hand_over_tensors_on_the_loads_device(
    tmp_path: Path, model8: list[Path], sharing: str
) -> None:
    """Forced to share through the page cache with a device other than the CPU (a GPU
    in production, torch's ``meta`` device here), the tensors a rank maps from another
    rank's file reach that device too, as its own do."""
    outs, _ = run_ranks(
        tmp_path, model8, 2, {"LOADERPLUG_RANK_SHARING": sharing, "RANK_DEVICE": "meta"}
    )
    want = {name: [dtype, shape, "meta"] for name, (dtype, shape, _crc) in expected(model8).items()}
    for out in outs:
        assert out.get("error") is None and out["tensors"] == want, out
        assert out["sharing"] == sharing


@pytest.mark.slow("ranks in processes of their own, each importing torch")
@pytest.mark.parametrize("sharing", ["broadcast", "pagecache", "stream"])
def test_ranks_loading_to_a_device_with_a_backend_get_every_tensor_whole(
    tmp_path: Path, model8: list[Path], sharing: str
) -> None:
    """Ranks loading to "cuda" through a device backend (the stand-in of
    loaderplug.testing.fake_device, whose memory is the host's, so the bytes can be
    compared): each reads its own files into pinned buffers and every rank gets every
    tensor, whatever the sharing mode. A broadcast moves device tensors only: no host
    copy; the modes that map another rank's file copy its pages to the device."""
    env = {"LOADERPLUG_RANK_SHARING": sharing, "RANK_DEVICE": "cuda", "RANK_FAKE_DEVICE": "1"}
    outs, _ = run_ranks(tmp_path, model8, 2, env)
    for out in outs:
        assert out.get("error") is None and out["tensors"] == expected(model8), out
        assert out["sharing"] == sharing and out["device_copied_bytes"] > 0
        assert (out["host_copied_bytes"] == 0) == (sharing == "broadcast"), out


@pytest.mark.slow("ranks in processes of their own, each importing torch")
@pytest.mark.parametrize("sharing", ["stream", "pagecache"])
def test_a_rank_that_cannot_map_a_file_fails_the_load_on_every_rank(
    tmp_path: Path, model8: list[Path], sharing: str
) -> None:
    """A receiver that cannot map another rank's file says so at once: every rank
    raises, naming it and the file, and none waits for it (nor for the timeout)."""
    outs, _ = run_ranks(
        tmp_path, model8, 2, {"LOADERPLUG_RANK_SHARING": sharing}, {1: {"RANK_MAP_FAIL": "1"}}
    )
    assert outs[0]["error"].startswith("DistributedError: rank 1 of the shared load failed")
    assert outs[1]["error"].startswith("LoaderplugError: cannot map model-"), outs[1]
    for out in outs:
        assert "cannot map model-" in out["error"] and "Cannot allocate memory" in out["error"]
    assert len(outs[0]["tensors"]) < len(expected(model8))


@pytest.mark.slow("ranks in processes of their own, each importing torch")
@pytest.mark.parametrize("sharing", ["pagecache", "broadcast", "stream"])
def test_ranks_divide_the_hosts_memory_budget(tmp_path: Path, sharing: str) -> None:
    """LOADERPLUG_BYTES_IN_FLIGHT bounds the host: each of two ranks loads within half of
    it, and, loading a cold model larger than the bound with a slow consumer, its peak
    stays within its half + 2 x the largest tensor + 256 MiB."""
    folder = tmp_path / "model"
    write_model(folder, 1024 * MiB, shards=8, tensors_per_shard=16)
    files = sorted(folder.glob("*.safetensors"))
    largest = max(t.nbytes for f in files for t in read_header_of(f).tensors)
    for f in files:
        drop_from_page_cache(f)  # read, not mapped: the budget is what holds the bytes
    host_budget = 512 * MiB
    env = {
        "LOADERPLUG_RANK_SHARING": sharing,
        "LOADERPLUG_BYTES_IN_FLIGHT": str(host_budget),
        "LOADERPLUG_SPAN_BYTES": "4M",
        "LOADERPLUG_SPLIT_THRESHOLD_BYTES": "8M",
        "RANK_TENSOR_SLEEP_S": "0.03",  # the consumer lags: the budget fills
    }
    outs, _ = run_ranks(tmp_path, files, 2, env)
    part = host_budget // 2
    bound = part + 2 * largest + 256 * MiB
    assert sum(f.stat().st_size for f in files) > 1.5 * bound  # the model does not fit
    for rank, out in enumerate(outs):
        assert out.get("error") is None and out["sharing"] == sharing, (rank, out)
        assert out["bytes_in_flight"] == part
        assert out["rss_growth"] <= bound, (rank, out["rss_growth"] / MiB, bound / MiB)


class _Work:
    """A collective as gloo hands it back: each wait raises or returns in turn."""

    def __init__(self, *waits: str) -> None:
        self.waits = list(waits)  # "timeout", "done" or "failed"

    def wait(self, timeout: object = None) -> bool:
        said = self.waits.pop(0)
        if said == "timeout":
            raise RuntimeError("Operation timed out!")
        if said == "failed":
            raise RuntimeError("Connection closed by peer")
        return True

    def is_completed(self) -> bool:
        return len(self.waits) <= 1  # completed by the time the slice ran out


@pytest.mark.parametrize(("second_wait", "fails"), [("done", False), ("failed", True)])
def test_a_collective_that_completes_as_its_wait_runs_out_is_done_not_failed(
    second_wait: str, fails: bool
) -> None:
    """A slice of a wait can run out ("timed out") just before the collective completes;
    it is then done if it went well (a rank once failed a sound load so), and an error
    only if waiting for it again raises."""
    from loaderplug.errors import DistributedError
    from loaderplug.tensors.ranks.peers import PeerWatch
    from loaderplug.tensors.ranks.steps import Steps
    from loaderplug.tensors.ranks.world import Share

    steps = Steps(
        Share(group=None, rank=0, size=2, global_ranks=(0, 1), timeout_s=60), PeerWatch(())
    )
    try:
        if fails:
            with pytest.raises(DistributedError, match="stopped answering"):
                steps._wait(_Work("timeout", second_wait))
        else:
            steps._wait(_Work("timeout", second_wait))
            assert steps.pending is None
    finally:
        steps.watch.close()
