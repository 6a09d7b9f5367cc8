"""What a shared load does where things go wrong around it: a forced sharing mode that
would map network files, a rank's own error, the groups it leaves behind, and ranks
that look like one host but do not share its filesystems."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from loaderplug.errors import DistributedError, FileError
from loaderplug.settings import from_env
from loaderplug.tensors.ranks.peers import PeerWatch
from loaderplug.tensors.ranks.steps import Steps
from loaderplug.tensors.ranks.teardown import tear_down
from loaderplug.tensors.ranks.world import Share, host_id
from loaderplug.testing.model import write_model
from loaderplug.testing.volume import VolumeProfile, mounted
from loaderplug.units import MiB
from tests.helpers.ranks import expected, run_ranks

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")

REPO = Path(__file__).resolve().parents[1]


def steps_alone() -> Steps:
    """Steps of a share whose collectives the test stands in for."""
    return Steps(
        Share(group=None, rank=0, size=2, global_ranks=(0, 1), timeout_s=60), PeerWatch(())
    )


@pytest.mark.fuse
@pytest.mark.distributed
@pytest.mark.slow("two ranks, processes that import torch, on a FUSE volume")
def test_a_forced_mapping_of_network_files_broadcasts_instead(tmp_path: Path) -> None:
    """LOADERPLUG_RANK_SHARING=pagecache with files read in place from a network
    filesystem: the ranks do not map them (a file truncated there would kill the
    process), they broadcast, and every rank gets every tensor."""
    backing = tmp_path / "backing"
    write_model(backing, 4 * MiB, shards=2)
    with mounted(backing, tmp_path / "mnt", VolumeProfile.unthrottled()) as vol:
        files = sorted(vol.mountpoint.glob("*.safetensors"))
        outs, _ = run_ranks(tmp_path, files, 2, {"LOADERPLUG_RANK_SHARING": "pagecache"})
    want = expected(sorted(backing.glob("*.safetensors")))
    for out in outs:
        assert out.get("error") is None and out["tensors"] == want, out
        assert out["sharing"] == "broadcast"


def test_a_failing_rank_raises_its_own_error_and_the_others_hear_of_it() -> None:
    steps = steps_alone()
    told: list[Any] = []

    def exchange(news: Any) -> list[Any]:
        told.append(news)
        raise DistributedError("rank 1 of the shared load failed too")

    steps.exchange = exchange  # type: ignore[method-assign]
    own = FileError("reading the header failed: Permission denied", path="model.safetensors")
    try:
        with pytest.raises(FileError) as raised:
            steps.fail(own)
    finally:
        steps.watch.close()
    assert raised.value is own
    assert told == [("error", str(own))]


def test_a_group_that_cannot_be_freed_hides_no_error_and_keeps_no_other_group(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import torch.distributed as dist

    freed: list[str] = []

    def destroy(group: str) -> None:
        if group == "broken":
            raise ValueError("Invalid process group specified")
        freed.append(group)

    monkeypatch.setattr(dist, "destroy_process_group", destroy)
    steps = steps_alone()
    with pytest.raises(FileError, match="the load's own"):
        try:
            raise FileError("the load's own error", path="model.safetensors")
        finally:
            tear_down(steps, ["broken", "data"])
    assert freed == ["data"]
    assert "could not free a group" in caplog.text


NEVER_STARTED = textwrap.dedent(
    """
    import datetime, gc, json, sys
    import torch.distributed as dist
    from loaderplug.settings import from_env
    from loaderplug.tensors.device.path import device_path_for
    from loaderplug.tensors.delivery.load import Load
    from loaderplug.tensors.ranks.world import Share
    from loaderplug.tensors.ranks.shared import shared_tensors

    dist.init_process_group(
        "gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    settings = from_env(progress=False)
    alive = {}
    for how in ("closed", "dropped"):
        group = dist.new_group([0], backend="gloo")
        share = Share(group, 0, 1, (0,), 60)
        load = Load(lambda load: iter(()))
        pairs = shared_tensors([], device_path_for("cpu", settings), None, settings, share, load)
        if how == "closed":
            pairs.close()
        else:
            del pairs
            gc.collect()
        alive[how] = group in dist.distributed_c10d._world.pg_map
    print(json.dumps(alive))
    """
)


@pytest.mark.distributed
@pytest.mark.slow("a process that imports torch")
def test_a_shared_load_never_started_frees_its_group(tmp_path: Path) -> None:
    script = tmp_path / "never_started.py"
    script.write_text(NEVER_STARTED)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "init")],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LOADERPLUG_IO_PROBE": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"closed": False, "dropped": False}


def test_ranks_that_do_not_share_filesystems_are_not_one_host(tmp_path: Path) -> None:
    """Same host name and boot (containers with the host's network), but another local
    folder under the same name, or another mount namespace: another host."""
    a, b = tmp_path / "a" / "local", tmp_path / "b" / "local"
    assert host_id(a) == host_id(a)
    assert host_id(a) != host_id(b)
    if shutil.which("unshare") is None:
        pytest.skip("no unshare to make a mount namespace")
    code = f"from loaderplug.tensors.ranks.world import host_id; print(host_id({str(a)!r}))"
    elsewhere = subprocess.run(
        ["unshare", "--mount", sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if elsewhere.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {elsewhere.stderr.strip()}")
    assert elsewhere.stdout.strip() != host_id(a)


def test_the_host_id_setting_still_decides() -> None:
    from loaderplug.tensors.ranks.world import RankProcess

    settings = from_env(host_id="rack-4/gpu-2", progress=False)
    assert RankProcess.here(settings, "/one").host == RankProcess.here(settings, "/two").host


@pytest.mark.distributed
@pytest.mark.slow("two ranks, processes that import torch")
def test_ranks_with_local_folders_of_their_own_each_load_alone(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    write_model(folder, 2 * MiB, shards=2)
    files = sorted(folder.glob("*.safetensors"))
    per_rank = {r: {"RANK_LOCAL_DIR": str(tmp_path / f"container-{r}" / "local")} for r in (0, 1)}
    outs, _ = run_ranks(tmp_path, files, 2, per_rank=per_rank)
    for out in outs:
        assert out.get("error") is None and out["tensors"] == expected(files), out
        assert out["sharing"] is None  # no other rank of its host
        assert sorted(out["reads"]) == sorted(f.name for f in files)
