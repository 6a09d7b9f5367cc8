"""Simulated hosts (loaderplug.testing.hosts): hostnames, a LAN between namespaces, a
gloo group across hosts, shaped and stalled links, a killed host, a volume per host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loaderplug.testing.hosts import (
    SimulatedHosts,
    host_volumes,
    hosts_unavailable_reason,
    sweep_leftovers,
)
from loaderplug.testing.volume import VolumeProfile, fuse_unavailable_reason
from loaderplug.units import MiB

UNAVAILABLE = hosts_unavailable_reason()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"hosts: {UNAVAILABLE}")

PORT = 7000  # each host's namespace is fresh: a fixed port is free there
# Where a test waits on a process: ranks import torch on shared cores, which takes
# seconds; a hang fails the test instead of stalling the run.
PATIENCE_S = 120

# Serve on host's address: print "ready", then for each connection either echo one
# message or, with "sink", count the bytes until EOF and print them with the time taken.
SERVER = """
import json, socket, sys, time
addr, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
srv = socket.create_server((addr, port))
print(json.dumps({"ready": socket.gethostname()}), flush=True)
while True:
    conn, _ = srv.accept()
    with conn:
        if mode == "echo":
            conn.sendall(conn.recv(4096))
            continue
        started, got = time.monotonic(), 0
        while chunk := conn.recv(1 << 20):
            got += len(chunk)
        print(json.dumps({"bytes": got, "seconds": time.monotonic() - started}), flush=True)
"""

# Connect to a server, then send a message and print its echo, or send N bytes.
CLIENT = """
import json, socket, sys
addr, port, timeout, payload = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
out = {"hostname": socket.gethostname()}
try:
    with socket.create_connection((addr, port), timeout=timeout) as conn:
        if payload.isdigit():
            conn.sendall(bytes(int(payload)))
        else:
            conn.sendall(payload.encode())
            out["echo"] = conn.recv(4096).decode()
except TimeoutError:
    out["error"] = "timeout"
print(json.dumps(out), flush=True)
"""


def finish(proc: subprocess.Popen[str], timeout_s: float = PATIENCE_S) -> tuple[int, str]:
    """Wait for ``proc``; its exit status and what it printed (stderr included)."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"process still running after {timeout_s} s:\n{out}")
    return proc.returncode, out


def last_json(out: str) -> dict[str, object]:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, out
    result: dict[str, object] = json.loads(lines[-1])
    return result


def next_json(proc: subprocess.Popen[str]) -> dict[str, object]:
    """The next line ``proc`` prints that is JSON (a library may warn in between)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            got: dict[str, object] = json.loads(line)
            return got
    pytest.fail(f"process exited with {proc.wait()} before printing a result")


def serve(hosts: SimulatedHosts, index: int, mode: str) -> subprocess.Popen[str]:
    """A server on host ``index``, once it listens."""
    argv = [sys.executable, "-c", SERVER, hosts[index].address, str(PORT), mode]
    proc = hosts[index].popen(argv, stdout=subprocess.PIPE, text=True)
    ready = next_json(proc)
    assert ready == {"ready": hosts[index].hostname}
    return proc


def connect(
    hosts: SimulatedHosts, src: int, dst: int, payload: str, timeout: float = 10, *, by_name=False
) -> dict[str, object]:
    """Run the client on host ``src`` against host ``dst``'s server (at its address, or
    its hostname); what it printed."""
    target = hosts[dst].hostname if by_name else hosts[dst].address
    argv = [sys.executable, "-c", CLIENT, target, str(PORT), str(timeout), payload]
    code, out = finish(hosts[src].popen(argv, stdout=subprocess.PIPE, text=True))
    assert code == 0, out
    return last_json(out)


def leftovers(hosts: SimulatedHosts) -> list[str]:
    """The hosts' namespaces and links that still exist."""
    namespaces, links = hosts.names()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    shown = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    present = {line.split()[0] for line in listed.splitlines() if line.strip()}
    present |= {line.split(":")[1].strip().split("@")[0] for line in shown.splitlines()}
    return sorted(set(namespaces + links) & present)


def test_two_hosts_have_their_own_names_reach_each_other_and_leave_nothing() -> None:
    with SimulatedHosts(2) as hosts:
        assert len(leftovers(hosts)) == 5  # two namespaces, a bridge, two veths
        server = serve(hosts, 1, "echo")
        answer = connect(hosts, 0, 1, "ping from 0")
        assert answer == {"hostname": "host0", "echo": "ping from 0"}
        answer = connect(hosts, 0, 1, "to a name", by_name=True)  # /etc/hosts has it
        assert answer == {"hostname": "host0", "echo": "to a name"}
        assert server.poll() is None
    assert server.returncode == -9  # killed on exit: it serves forever
    assert leftovers(hosts) == []


def test_an_exception_inside_still_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="inside"), SimulatedHosts(3, link_mbit=100) as hosts:
        sleeper = hosts[2].popen(["sleep", "600"], own_pids=True)
        deadline = time.monotonic() + 10
        while not hosts[2].pids():  # it is in the namespace once nsenter has run
            assert time.monotonic() < deadline, "the process never entered host 2"
            time.sleep(0.01)
        raise RuntimeError("inside")
    assert sleeper.returncode is not None
    assert leftovers(hosts) == []


def test_torchrun_variables_place_ranks_host_by_host() -> None:
    hosts = SimulatedHosts(3)  # not entered: the variables need no namespace
    envs = hosts.torchrun_environments(2, port=29500)
    assert [e["RANK"] for e in envs] == [str(r) for r in range(6)]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1", "2", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"] * 3
    assert {e["MASTER_ADDR"] for e in envs} == {hosts[0].address}
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_PORT"]) for e in envs} == {
        ("6", "2", "29500")
    }
    assert len({h.address for h in hosts}) == 3


def test_a_dead_runs_leftovers_are_swept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"lphosts-{dead.pid}-0-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in sweep_leftovers()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert name not in listed


def transfer_rate_mbit(hosts: SimulatedHosts, nbytes: int) -> float:
    """Send ``nbytes`` from host 0 to host 1's sink; the rate host 1 measured."""
    sink = serve(hosts, 1, "sink")
    connect(hosts, 0, 1, str(nbytes), timeout=60)
    received = next_json(sink)
    assert received["bytes"] == nbytes
    sink.kill()
    finish(sink)
    return float(nbytes * 8 / received["seconds"] / 1e6)


@pytest.mark.slow("sends 8 MiB at 40 Mbit/s and 2 MiB at 10 Mbit/s (about 1.7 s each)")
def test_the_link_rate_is_applied_and_changed_at_run_time() -> None:
    with SimulatedHosts(2, link_mbit=40) as hosts:
        rate = transfer_rate_mbit(hosts, 8 * MiB)
        print(f"8 MiB at 40 Mbit/s: {rate:.1f} Mbit/s")
        assert rate < 1.5 * 40
        hosts.set_rate(1, 10)  # host 1's download is now the narrowest
        rate = transfer_rate_mbit(hosts, 2 * MiB)
        print(f"2 MiB at 10 Mbit/s: {rate:.1f} Mbit/s")
        assert rate < 1.5 * 10


@pytest.mark.slow("connections wait out their timeouts (3 s)")
def test_a_stalled_host_times_out_its_peers_until_unstalled() -> None:
    with SimulatedHosts(2, link_mbit=100) as hosts:
        serve(hosts, 1, "echo")
        assert connect(hosts, 0, 1, "before")["echo"] == "before"
        hosts.stall(1)
        started = time.monotonic()
        assert connect(hosts, 0, 1, "stalled", timeout=2)["error"] == "timeout"
        assert time.monotonic() - started >= 2
        hosts.set_rate(1, 50)  # a new rate does not revive a stalled host
        assert connect(hosts, 0, 1, "still stalled", timeout=1)["error"] == "timeout"
        hosts.unstall(1)
        assert connect(hosts, 0, 1, "after")["echo"] == "after"


# A rank: join the group from torchrun's variables, all_reduce and broadcast, print what
# it got; with RANK_THEN_WAIT, then wait (rank 0: for a line on stdin, then all_reduce
# again, exiting 3 with the error if it fails; the others: forever).
RANK = """
import datetime, json, os, socket, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ["T"])))
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
sent = torch.arange(4.0) + 100 if rank == world - 1 else torch.zeros(4)
dist.broadcast(sent, src=world - 1)
print(json.dumps({"rank": rank, "host": socket.gethostname(), "sum": total.item(),
                  "broadcast": sent.tolist(), "env": {k: os.environ[k] for k in
                  ("LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "GLOO_SOCKET_IFNAME")}}),
      flush=True)
if not os.environ.get("RANK_THEN_WAIT"):
    dist.destroy_process_group()  # without it, torch aborts the process on its exit
    sys.exit(0)
if rank != 0:
    time.sleep(600)
sys.stdin.readline()
try:
    dist.all_reduce(total)
except Exception as e:
    print(f"collective failed: {type(e).__name__}: {e}", flush=True)
    os._exit(3)  # a broken group's teardown would abort the process
"""


@pytest.mark.slow("four ranks import torch and form a gloo group")
@pytest.mark.distributed
def test_a_gloo_group_across_two_hosts_of_two_ranks() -> None:
    pytest.importorskip("torch.distributed")
    with SimulatedHosts(2, link_mbit=1000) as hosts:
        env = dict(os.environ, T="60")
        ranks = hosts.start_ranks(
            [sys.executable, "-c", RANK],
            2,
            env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        results = [finish(rank) for rank in ranks]
    for rank, (code, out) in enumerate(results):
        assert code == 0, out
        got = last_json(out)
        assert got["rank"] == rank
        assert got["host"] == f"host{rank // 2}"
        assert got["sum"] == 1 + 2 + 3 + 4
        assert got["broadcast"] == [100.0, 101.0, 102.0, 103.0]
        assert got["env"] == {
            "LOCAL_RANK": str(rank % 2),
            "GROUP_RANK": str(rank // 2),
            "MASTER_ADDR": hosts[0].address,
            "GLOO_SOCKET_IFNAME": "eth0",
        }


WHY = {"killed": "Connection closed by peer", "vanished": "Timed out"}


@pytest.mark.slow("two ranks import torch; the vanished host's peer waits out a 5 s timeout")
@pytest.mark.distributed
@pytest.mark.crash
@pytest.mark.parametrize("how", ["killed", "vanished"])
def test_a_collective_with_a_dead_host_raises(how: str) -> None:
    pytest.importorskip("torch.distributed")
    with SimulatedHosts(2, link_mbit=1000) as hosts:
        env = dict(os.environ, T="5", RANK_THEN_WAIT="1")
        ranks = hosts.start_ranks(
            [sys.executable, "-c", RANK], 1, env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for rank in ranks:
            assert next_json(rank)["sum"] == 3.0  # the group works, then:
        if how == "vanished":
            hosts.stall(1)  # its processes' last words never arrive
        hosts[1].kill()
        assert ranks[1].returncode is not None and hosts[1].pids() == []
        assert ranks[0].stdin is not None
        ranks[0].stdin.write("go\n")
        ranks[0].stdin.flush()
        code, out = finish(ranks[0])
    assert code == 3, out
    # A killed process's kernel closes its connections; a vanished host says nothing.
    assert "collective failed: RuntimeError:" in out
    assert WHY[how] in out


@pytest.mark.slow("mounts two FUSE volumes, each served by a process of its own")
@pytest.mark.fuse
def test_each_host_counts_the_bytes_read_through_its_own_volume(tmp_path: Path) -> None:
    assert fuse_unavailable_reason() is None
    source = tmp_path / "source"
    source.mkdir()
    (source / "weights.bin").write_bytes(os.urandom(MiB))
    throttle = VolumeProfile(per_stream_bytes_per_s=64 * MiB)
    with (
        SimulatedHosts(2) as hosts,
        host_volumes(hosts, source, tmp_path / "hosts", throttle) as storages,
    ):
        assert storages[0].local != storages[1].local and storages[0].local.is_dir()
        path = storages[0].volume.mountpoint / "weights.bin"
        read = f"print(len(open({str(path)!r}, 'rb').read()))"
        # Its own mount namespace too: the volume must be reachable from one.
        proc = hosts[0].popen([sys.executable, "-c", read], stdout=subprocess.PIPE, text=True)
        code, out = finish(proc)
        assert (code, out.strip()) == (0, str(MiB))
        assert storages[0].volume.stats()["bytes_read"] >= MiB
        assert storages[1].volume.stats()["bytes_read"] == 0
