"""Simulated hosts on one Linux machine: ranks of a group "on" up to 16 hosts, for tests.

Ranks spread over several hosts differ from ranks on one host in three ways that a test
must reproduce: each host has its own network address and link (the collectives cross a
network with a bandwidth of its own, which can stall), its own hostname (which is how
ranks tell hosts apart), and its own view of the volume and local disk. `SimulatedHosts`
builds that with the kernel's namespaces, and needs root:

* each host is a network namespace with loopback up and one veth pair whose other end
  is a port of a bridge in the root namespace, so the hosts form one LAN
  (10.x.y.h/24, x and y from the pid) that the root namespace has no address on;
* a host's link is shaped with a ``tc`` token bucket (tbf) on both ends of its veth, so
  its upload and its download each get the rate; `SimulatedHosts.stall` swaps both for a
  ``blackhole`` qdisc, which drops every packet without an error: peers time out, as
  they do when a host stops answering;
* `Host.popen` runs a process in the host's network namespace (``nsenter``), a new
  UTS namespace with the host's hostname and a new mount namespace whose ``/etc/hosts``
  names every host (``unshare``), and if asked a pid namespace; `Host.kill` kills
  every process in the host's network namespace;
* `host_volumes` mounts a FUSE test volume (`loaderplug.testing.volume`) per host over
  one source folder, each with its own throttle and byte counters, and a local folder.

Names carry the pid (and a sequence number), so parallel test runs do not collide, and
leftovers of a killed run are swept by the next one. Gotchas: a host's process gets its
mounts as a slave copy (``--propagation slave``; unshare's default, private, would keep
a volume the test unmounts mounted there, and its FUSE server from exiting); netem is
not in every kernel, which is why a stall is a blackhole, not a 100% loss; a bridge seen by
``br_netfilter`` obeys the root namespace's iptables (a FORWARD policy of DROP cuts the
hosts apart).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from loaderplug.testing.volume import TestVolume, VolumeProfile, mounted

__all__ = [
    "Host",
    "HostStorage",
    "SimulatedHosts",
    "free_port",
    "host_volumes",
    "hosts_unavailable_reason",
    "sweep_leftovers",
]

INTERFACE = "eth0"  # the host's end of its veth, as seen inside its namespace
NETNS_PREFIX = "lphosts-"
_COMMANDS = ("ip", "tc", "nsenter", "unshare", "hostname", "mount")
_sequence = itertools.count()


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command; a failure raises with the command's own words."""
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {res.stderr.strip()}")
    return res


@functools.cache
def hosts_unavailable_reason() -> str | None:
    """Why simulated hosts cannot be built here, or None if they can."""
    if os.geteuid() != 0:
        return "not root (network namespaces, veth pairs and tc need it)"
    missing = [name for name in _COMMANDS if shutil.which(name) is None]
    if missing:
        return f"missing commands: {', '.join(missing)}"
    probe = f"{NETNS_PREFIX}probe-{os.getpid()}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        enter = ["nsenter", f"--net=/run/netns/{probe}", "unshare", "--uts", "true"]
        res = _run(enter, check=False)
        if res.returncode != 0:
            return f"cannot enter a network namespace and unshare UTS: {res.stderr.strip()}"
        veth = _run(
            ["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "p1"], check=False
        )
        if veth.returncode != 0:
            return f"cannot make a veth pair: {veth.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def free_port() -> int:
    """A TCP port free now. Asked in the root namespace: a host's namespace is fresh,
    so the port is free there too unless a process of the test took it since."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        port: int = probe.getsockname()[1]
        return port


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers() -> list[str]:
    """Delete the namespaces, links and hosts files of runs whose process is gone (a
    killed test run cannot clean up); the names it deleted."""
    swept: list[str] = []
    for folder in Path(tempfile.gettempdir()).glob("lphosts-" + "[0-9a-f]" * 8):
        if not _alive(int(folder.name[8:14], 16)):
            shutil.rmtree(folder, ignore_errors=True)
            swept.append(str(folder))
    netns = _run(["ip", "netns", "list"], check=False).stdout
    for match in re.finditer(rf"^({NETNS_PREFIX}(\d+)-\S+)", netns, re.M):
        if not _alive(int(match.group(2))):
            _run(["ip", "netns", "del", match.group(1)], check=False)
            swept.append(match.group(1))
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for match in re.finditer(r"^\d+: (lp[bv]([0-9a-f]{6})[0-9a-f]*)[@:]", links, re.M):
        if not _alive(int(match.group(2), 16)):
            _run(["ip", "link", "del", match.group(1)], check=False)
            swept.append(match.group(1))
    return swept


@dataclass
class Host:
    """One simulated host: a network namespace with an address, a hostname, a link."""

    index: int
    hostname: str
    netns: str
    address: str  # IPv4, without the prefix length
    link: str  # the root namespace's end of the host's veth (a bridge port)
    hosts_file: str  # bound over /etc/hosts in its processes: every host by name
    interface: str = INTERFACE
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, argv: Sequence[str], *, own_pids: bool = False) -> list[str]:
        """``argv`` wrapped to run on this host: in its network namespace, a UTS namespace
        with its hostname, a mount namespace where ``/etc/hosts`` names every host (a
        slave copy of the root's: the test's mounts and unmounts reach it, its own stay
        in it), and if asked a pid namespace whose init is ``argv``."""
        unshare = ["unshare", "--uts", "--mount", "--propagation", "slave"]
        if own_pids:
            # /proc of its own, so the process sees its pid namespace; --kill-child so
            # the namespace dies with the unshare process a kill aims at.
            unshare += ["--pid", "--fork", "--kill-child", "--mount-proc"]
        # Names resolve from the file, never through a DNS server the LAN cannot reach
        # (c10d and gloo look the peers' addresses up, and warn or wait when that fails).
        script = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
        return [
            "nsenter",
            f"--net=/run/netns/{self.netns}",
            *unshare,
            "sh",
            "-c",
            script,
            self.hostname,
            self.hosts_file,
            *argv,
        ]

    def popen(
        self,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        *,
        own_pids: bool = False,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on this host (see `command`); `kill` and the hosts' exit stop
        it. It gets a session of its own, so a kill reaches its children too."""
        wrapped = self.command(argv, own_pids=own_pids)
        proc = subprocess.Popen(wrapped, env=env, start_new_session=True, **kwargs)
        self.processes.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process in this host's network namespace, whoever started it."""
        out = _run(["ip", "netns", "pids", self.netns], check=False).stdout
        return [int(pid) for pid in out.split()]

    def kill(self) -> None:
        """Kill every process on this host with SIGKILL, as a host that dies would lose
        them, and reap the ones started with `popen`."""
        for proc in self.processes:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in self.pids():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.processes:
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def _tbf(mbit: float) -> list[str]:
    """A token bucket at ``mbit``: its burst must hold a 64 KiB GSO packet and a tick
    of the rate, or the qdisc drops what it cannot ever send."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes / 100))
    return ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "100ms"]


class SimulatedHosts:
    """``count`` hosts on one LAN, each link at ``link_mbit`` (None: unshaped); a context
    manager that removes every namespace, link and process on exit."""

    def __init__(self, count: int, link_mbit: float | None = None) -> None:
        if not 1 <= count <= 16:
            raise ValueError(f"between 1 and 16 hosts, not {count}")
        pid, seq = os.getpid(), next(_sequence) % 256
        self.tag = f"{pid:06x}{seq:02x}"
        self.bridge = f"lpb{self.tag}"
        subnet = f"10.{(pid >> 8) & 0xFF}.{pid & 0xFF}"
        self._folder = os.path.join(tempfile.gettempdir(), f"lphosts-{self.tag}")
        hosts_file = os.path.join(self._folder, "hosts")
        self.hosts = [
            Host(
                index=i,
                hostname=f"host{i}",
                netns=f"{NETNS_PREFIX}{pid}-{seq}-{i}",
                address=f"{subnet}.{i + 1}",
                link=f"lpv{self.tag}{i:x}",
                hosts_file=hosts_file,
            )
            for i in range(count)
        ]
        self._rates: dict[int, float | None] = {i: link_mbit for i in range(count)}
        self._stalled: set[int] = set()
        self._built: list[tuple[str, str]] = []  # ("netns" | "link", name), in order made

    def __enter__(self) -> SimulatedHosts:
        sweep_leftovers()
        try:
            self._write_hosts_file()
            self._make(("link", self.bridge), ["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "up"])
            for host in self.hosts:
                self._make_host(host)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def _write_hosts_file(self) -> None:
        os.makedirs(self._folder, exist_ok=True)
        with open(self.hosts[0].hosts_file, "w", encoding="utf-8") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{h.address} {h.hostname}\n" for h in self.hosts)
            # A dual-stack server (c10d's store) sees its IPv4 peers as mapped IPv6
            # addresses, which the resolver looks up as they are.
            f.writelines(f"::ffff:{h.address} {h.hostname}\n" for h in self.hosts)

    def _make(self, what: tuple[str, str], argv: list[str]) -> None:
        _run(argv)
        self._built.append(what)

    def _make_host(self, host: Host) -> None:
        """The host's namespace, its veth into the bridge, its address and its rate."""
        self._make(("netns", host.netns), ["ip", "netns", "add", host.netns])
        inside = ["ip", "-n", host.netns]
        _run([*inside, "link", "set", "lo", "up"])
        veth = ["ip", "link", "add", host.link, "type", "veth", "peer", "name", host.interface]
        self._make(("link", host.link), [*veth, "netns", host.netns])
        _run(["ip", "link", "set", host.link, "master", self.bridge, "up"])
        _run([*inside, "addr", "add", f"{host.address}/24", "dev", host.interface])
        _run([*inside, "link", "set", host.interface, "up"])
        self._shape(host.index, self._rates[host.index])

    def _qdisc(self, index: int, qdisc: list[str] | None) -> None:
        """Put ``qdisc`` at the root of both ends of a host's veth (None: the default)."""
        host = self.hosts[index]
        ends = ((["tc"], host.link), (["tc", "-n", host.netns], host.interface))
        for tc, dev in ends:
            if qdisc is None:
                _run([*tc, "qdisc", "del", "dev", dev, "root"], check=False)
            else:
                _run([*tc, "qdisc", "replace", "dev", dev, "root", *qdisc])

    def _shape(self, index: int, mbit: float | None) -> None:
        self._qdisc(index, None if mbit is None else _tbf(mbit))

    def set_rate(self, index: int, mbit: float | None) -> None:
        """Shape host ``index``'s link to ``mbit`` each way (None: unshaped), now; a
        stalled host keeps dropping everything and gets the rate when unstalled."""
        self._rates[index] = mbit
        if index not in self._stalled:
            self._shape(index, mbit)

    def stall(self, index: int) -> None:
        """Drop every packet to and from host ``index``, silently: its peers time out."""
        self._qdisc(index, ["blackhole"])
        self._stalled.add(index)

    def unstall(self, index: int) -> None:
        """Give host ``index`` its link back, at the rate it had."""
        self._shape(index, self._rates[index])
        self._stalled.discard(index)

    def names(self) -> tuple[list[str], list[str]]:
        """The namespaces and the root namespace's links these hosts are made of."""
        return [h.netns for h in self.hosts], [self.bridge, *(h.link for h in self.hosts)]

    def torchrun_environments(
        self, ranks_per_host: int | Sequence[int], port: int | None = None
    ) -> list[dict[str, str]]:
        """What torchrun would set for each rank (index = global rank) with
        ``ranks_per_host`` ranks on each host (a count per host: hosts of unequal
        ranks, as torchrun starts when its nodes differ), rank 0 on host 0 serving the
        store."""
        port = port or free_port()
        counts = (
            [ranks_per_host] * len(self.hosts)
            if isinstance(ranks_per_host, int)
            else list(ranks_per_host)
        )
        envs: list[dict[str, str]] = []
        for host, count in zip(self.hosts, counts, strict=True):
            for local in range(count):
                envs.append(
                    {
                        "RANK": str(len(envs)),
                        "WORLD_SIZE": str(sum(counts)),
                        "LOCAL_RANK": str(local),
                        "LOCAL_WORLD_SIZE": str(count),
                        "GROUP_RANK": str(host.index),
                        "GROUP_WORLD_SIZE": str(len(self.hosts)),
                        "MASTER_ADDR": self.hosts[0].address,
                        "MASTER_PORT": str(port),
                        "GLOO_SOCKET_IFNAME": host.interface,
                    }
                )
        return envs

    def start_ranks(
        self,
        argv: Sequence[str],
        ranks_per_host: int | Sequence[int],
        env: dict[str, str] | None = None,
        **kw: Any,
    ) -> list[subprocess.Popen[Any]]:
        """Start ``argv`` once per rank, each on its host with torchrun's variables over
        ``env`` (default: this process's); the processes, by global rank."""
        base = dict(os.environ if env is None else env)
        return [
            self.hosts[int(rank_env["GROUP_RANK"])].popen(argv, env={**base, **rank_env}, **kw)
            for rank_env in self.torchrun_environments(ranks_per_host)
        ]

    def close(self) -> None:
        """Kill every host's processes, then delete what was made, newest first; every
        step is tried, and the first failure is raised at the end."""
        errors: list[str] = []
        for host in self.hosts:
            try:
                host.kill()
            except (OSError, RuntimeError) as e:
                errors.append(f"kill {host.hostname}: {e}")
        while self._built:
            kind, name = self._built.pop()
            argv = ["ip", "netns", "del", name] if kind == "netns" else ["ip", "link", "del", name]
            res = _run(argv, check=False)
            # A veth's peer goes with it: deleting the root's end first leaves nothing.
            if res.returncode != 0 and "Cannot find device" not in res.stderr:
                errors.append(f"{' '.join(argv)}: {res.stderr.strip()}")
        shutil.rmtree(self._folder, ignore_errors=True)
        if errors:
            raise RuntimeError("simulated hosts not cleaned up: " + "; ".join(errors))


@dataclass(frozen=True)
class HostStorage:
    """A host's view of the storage: its own mount of the volume, its own local disk."""

    host: Host
    volume: TestVolume
    local: Path


@contextmanager
def host_volumes(
    hosts: Sequence[Host] | SimulatedHosts,
    source: Path,
    workdir: Path,
    profile: VolumeProfile | Sequence[VolumeProfile] = VolumeProfile(),  # noqa: B008 - frozen
) -> Iterator[list[HostStorage]]:
    """Mount ``source`` once per host under ``workdir/<hostname>/volume``, each mount
    with its own throttle (``profile``, or one per host) and counters, beside a local
    folder ``workdir/<hostname>/local``. The mounts are in the root mount namespace,
    which every host's processes see (a network namespace changes no mounts)."""
    hosts = list(hosts)
    profiles = [profile] * len(hosts) if isinstance(profile, VolumeProfile) else list(profile)
    if len(profiles) != len(hosts):
        raise ValueError(f"{len(profiles)} profiles for {len(hosts)} hosts")
    with ExitStack() as stack:
        storages = []
        for host, host_profile in zip(hosts, profiles, strict=True):
            base = Path(workdir) / host.hostname
            local = base / "local"
            local.mkdir(parents=True, exist_ok=True)
            volume = stack.enter_context(mounted(source, base / "volume", host_profile))
            storages.append(HostStorage(host, volume, local))
        yield storages
