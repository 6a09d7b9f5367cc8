"""Shared fixtures: small synthetic models, fault-injecting plugins, real test mounts."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loaderplug.jobs.file_sink import is_temp_name
from loaderplug.jobs.model_folder import is_own_name
from loaderplug.plugins import manager as plugins
from loaderplug.plugins.hookspecs import hookimpl
from loaderplug.storage.source import PosixSource
from loaderplug.testing.model import write_model
from loaderplug.types import Identity, IOPolicy
from tests.hubserver import hub as hub

# Small ranges so a few MiB exercise many spans per file; quick backoff.
FAST = {
    "span_bytes": "64K",
    "split_threshold_bytes": "128K",
    "readers": 4,
    "retry_base_ms": 1,
    "retry_max_ms": 4,
    "progress": False,
}


_RANKS_ON_HOSTS = "ranks on simulated hosts, processes that import torch"
# Tests that take seconds (measured on 2 cores, the whole suite on 4 workers), marked
# ``slow`` here rather than in their files, with the reason, so that the edit loop
# (``pytest -m "not slow"``) leaves them out. A test id without its parameters names
# every case; tests/test_suite_tiers.py checks that each still names a test.
SLOW_TESTS: dict[str, str] = {
    **{
        f"tests/test_host_split.py::{name}": _RANKS_ON_HOSTS
        for name in (
            "test_two_hosts_each_read_half_and_publish_whole_copies",
            "test_hosts_whose_mirrors_differ_do_not_split_and_each_loads_its_own",
            "test_a_local_folder_held_by_another_job_is_not_split_and_waited_for",
            "test_off_reads_everything_on_every_host",
            "test_hosts_with_unequal_rank_counts_split_and_every_rank_gets_every_tensor",
            "test_hosts_passing_the_files_in_another_order_split_by_name",
            "test_ranks_of_one_host_passing_the_files_in_another_order_share_them_by_name",
            "test_ranks_passing_different_files_fail_on_every_host_with_the_same_cause",
        )
    },
    "tests/test_suite_guard.py::"
    "test_a_test_skipped_for_a_missing_package_fails_the_test_scripts_run": (
        "a pytest run in a process"
    ),
    "tests/test_suite_guard.py::test_elsewhere_it_is_only_skipped": "a pytest run in a process",
    "tests/test_hostile_links.py::test_hostile_trees_change_nothing_outside_the_destination": (
        "a dozen random hostile mirrors, a hydrate process each"
    ),
    "tests/test_upstream.py::test_vllm_without_its_base_loader": "imports vLLM",
    "tests/test_truncation.py::test_tensors_of_an_owned_load_survive_its_files_shrinking": (
        "a process that imports torch per trial"
    ),
    "tests/test_header_fuzz.py::test_files_safetensors_writes_load_equal": (
        "hypothesis writes a file with safetensors per example"
    ),
}


def _mark_slow_by_table(items: list[pytest.Item]) -> None:
    for item in items:
        reason = SLOW_TESTS.get(item.nodeid) or SLOW_TESTS.get(item.nodeid.split("[")[0])
        if reason is not None:
            item.add_marker(pytest.mark.slow(reason))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A ``slow`` test must say why it is slow (SLOW_TESTS marks some here); tests
    marked ``fuse`` are skipped, with the reason, where FUSE is missing. The tests that
    start vLLM come first: run in parallel (``-n``), their groups are the longest, and
    start at once. This runs before ``-m`` deselects: ``-m "not slow"`` sees the marks."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is None)
    _mark_slow_by_table(items)
    unexplained = [item.nodeid for item in items if _slow_without_a_reason(item)]
    if unexplained:
        raise pytest.UsageError(
            'a slow test says why in its marker, @pytest.mark.slow("starts vLLM"): '
            + ", ".join(unexplained)
        )
    fuse_tests = [item for item in items if item.get_closest_marker("fuse")]
    if not fuse_tests:
        return
    from loaderplug.testing.volume import fuse_unavailable_reason

    reason = fuse_unavailable_reason()
    if reason is not None:
        for item in fuse_tests:
            item.add_marker(pytest.mark.skip(reason=f"FUSE: {reason}"))


# scripts/test.sh installs every package a test imports, and sets this: there, a test
# skipped because a package is missing fails the run instead of passing unseen.
NEED_EVERY_PACKAGE = "TESTS_NEED_EVERY_PACKAGE"
_MISSING_PACKAGE = re.compile(r"could not import '[^']+'|No module named '[^']+'")
_skipped_for_a_package: list[str] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_missing_package(report)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_missing_package(report)


def _note_missing_package(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    found = _MISSING_PACKAGE.search(str(report.longrepr[2]))
    if found is not None:
        _skipped_for_a_package.append(f"{report.nodeid}: {found.group(0)}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_for_a_package and os.environ.get(NEED_EVERY_PACKAGE) == "1":
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _skipped_for_a_package and os.environ.get(NEED_EVERY_PACKAGE) == "1":
        terminalreporter.section("skipped for a package scripts/test.sh installs", red=True)
        for line in _skipped_for_a_package:
            terminalreporter.line(line)


def _slow_without_a_reason(item: pytest.Item) -> bool:
    return any(
        not (mark.args and isinstance(mark.args[0], str) and mark.args[0].strip())
        for mark in item.iter_markers("slow")
    )


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("LOADERPLUG_"):
            monkeypatch.delenv(name)
    # A measured IO policy is kept per user and mount: a test's (or a benchmark's) must
    # not decide another's. tests/test_io_probe.py measures where it is the subject.
    monkeypatch.setenv("LOADERPLUG_IO_PROBE", "0")


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    """Three small safetensors shards (needs torch and safetensors)."""
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from tests.helpers.tensors import write_shards

    return write_shards(tmp_path)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A 4-shard, ~2 MiB safetensors model with an index and a config."""
    folder = tmp_path / "mirror"
    write_model(folder, 2 << 20, shards=4)
    return folder


def drop_from_page_cache(path: str | os.PathLike[str]) -> None:
    """Make the next read of ``path`` come from the disk (as a cold start would)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every regular file under root (symlinks excluded), by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and not is_own_name(p.name)
    }


def leftover_temps(root: Path) -> list[Path]:
    """Temp files, partial copies and their journals under ``root``."""
    return [p for p in root.rglob(".*") if is_temp_name(p.name)]


class FaultySource:
    """Wraps the built-in source; raises the plugin's planned errors on reads."""

    def __init__(self, inner: PosixSource, plugin: FaultPlugin) -> None:
        self.inner, self.plugin = inner, plugin

    @property
    def size(self) -> int:
        return self.inner.size

    def identity(self) -> Identity:
        return self.inner.identity()

    def pread_into(self, buf: memoryview, offset: int) -> int:
        self.plugin.before_read(self.inner.path, offset)
        return self.inner.pread_into(buf, offset)

    def close(self) -> None:
        self.inner.close()


class FaultPlugin:
    """Injects ``error`` on reads of files whose name contains ``match``.

    ``times`` caps how many reads fail (None: every read); ``at_offset`` restricts
    faults to reads at or past that offset.
    """

    def __init__(
        self, error: int, match: str = "", times: int | None = None, at_offset: int = 0
    ) -> None:
        self.error, self.match, self.times, self.at_offset = error, match, times, at_offset
        self.injected = 0
        self.reads: list[tuple[str, int]] = []
        self.hook: threading.Event | None = None
        self._lock = threading.Lock()

    def before_read(self, path: str, offset: int) -> None:
        with self._lock:
            self.reads.append((path, offset))
            hit = self.match in path and offset >= self.at_offset
            if hit and (self.times is None or self.injected < self.times):
                self.injected += 1
                raise OSError(self.error, os.strerror(self.error), path)

    @hookimpl
    def loaderplug_open_source(self, path: str, policy: IOPolicy) -> FaultySource | None:
        # Other paths fall through to the next plugin (another FaultPlugin or the built-in).
        return FaultySource(PosixSource(path, policy), self) if self.match in path else None


@pytest.fixture
def register_plugin() -> Iterator[Callable[[object], object]]:
    """Register plugins for one test (``register_plugin(Plugin())``); every one is
    unregistered when the test ends, whatever happens."""
    registered: list[object] = []

    def add(plugin: object) -> object:
        plugins.register(plugin)
        registered.append(plugin)
        return plugin

    yield add
    for plugin in reversed(registered):
        plugins.unregister(plugin)


@pytest.fixture
def inject(register_plugin: Callable[[object], object]) -> Callable[..., FaultPlugin]:
    """Register fault plugins for one test: ``plugin = inject(errno.EIO, "00002")``."""

    def make(*args: int | str | None, **kwargs: int | str | None) -> FaultPlugin:
        plugin = FaultPlugin(*args, **kwargs)  # type: ignore[arg-type]
        register_plugin(plugin)
        return plugin

    return make


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, to run out of space for real."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


ENOMEM, EIO, EAGAIN, EACCES = errno.ENOMEM, errno.EIO, errno.EAGAIN, errno.EACCES


@pytest.fixture
def volume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty mirror root as ``LOADERPLUG_MIRROR`` (its Hub repos go under ``hub/``)."""
    vol = tmp_path / "volume"
    vol.mkdir()
    monkeypatch.setenv("LOADERPLUG_MIRROR", str(vol))
    monkeypatch.setenv("LOADERPLUG_FSYNC", "0")
    monkeypatch.setenv("LOADERPLUG_PROGRESS", "0")
    monkeypatch.setenv("LOADERPLUG_READERS", "3")
    return vol
