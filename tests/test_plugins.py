"""Each hook, entry-point plugins, and LOADERPLUG_DISABLE_PLUGINS."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loaderplug import IOPolicy, MirrorRequest, PluginError, hookimpl, hydrate
from loaderplug.plugins import _build, first_result, plugin_manager
from loaderplug.report import FileResult, TransferReport
from loaderplug.source import Identity
from tests.conftest import FAST, tree_bytes


@pytest.fixture
def register() -> Iterator[object]:
    added: list[object] = []

    def add(plugin: object) -> object:
        plugin_manager().register(plugin)
        added.append(plugin)
        return plugin

    yield add
    for plugin in added:
        plugin_manager().unregister(plugin)


def test_loaderplug_find_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, register) -> None:
    pm = plugin_manager()
    request = MirrorRequest("folder", "acme/tiny")
    assert pm.hook.loaderplug_find_mirror(request=request) is None  # no volume configured
    (tmp_path / "vol/models/acme/tiny").mkdir(parents=True)
    monkeypatch.setenv("LOADERPLUG_VOLUME", str(tmp_path / "vol"))
    assert pm.hook.loaderplug_find_mirror(request=request) == tmp_path / "vol/models/acme/tiny"

    class Elsewhere:
        @hookimpl
        def loaderplug_find_mirror(self, request: MirrorRequest) -> Path:
            return tmp_path / "other" / request.name

    register(Elsewhere())  # a third-party plugin wins over the built-in
    assert pm.hook.loaderplug_find_mirror(request=request) == tmp_path / "other/acme/tiny"


def test_loaderplug_io_policy(model: Path, tmp_path: Path, register) -> None:
    seen: list[IOPolicy] = []

    class Buffered:
        @hookimpl
        def loaderplug_io_policy(self, path: str, mode: str) -> IOPolicy:
            return IOPolicy.buffered("testfs", "a plugin said so")

    class Spy:
        @hookimpl(hookwrapper=True)
        def loaderplug_open_source(self, path: str, policy: IOPolicy):  # type: ignore[no-untyped-def]
            seen.append(policy)
            yield

    register(Buffered())
    register(Spy())
    hydrate(model, tmp_path / "local", **FAST)
    assert seen and {p.reason for p in seen} == {"a plugin said so"}


def test_loaderplug_open_source(model: Path, tmp_path: Path, register) -> None:
    """A plugin can serve another backend: here, every file's bytes come from memory."""
    content = {str(model / rel): data.upper() for rel, data in tree_bytes(model).items()}

    class MemorySource:
        def __init__(self, path: str) -> None:
            self.data = content[path]
            self.ident = Identity.of(Path(path).stat())

        @property
        def size(self) -> int:
            return len(self.data)

        def identity(self) -> Identity:
            return self.ident

        def pread_into(self, buf: memoryview, offset: int) -> int:
            chunk = self.data[offset : offset + len(buf)]
            buf[: len(chunk)] = chunk
            return len(chunk)

        def close(self) -> None:
            pass

    class Memory:
        @hookimpl
        def loaderplug_open_source(self, path: str, policy: IOPolicy) -> MemorySource:
            return MemorySource(path)

    register(Memory())
    hydrate(model, tmp_path / "local", **FAST)
    assert tree_bytes(tmp_path / "local") == {
        rel: data.upper() for rel, data in tree_bytes(model).items()
    }


def test_loaderplug_on_range_done(model: Path, tmp_path: Path, register) -> None:
    ranges: dict[str, list[tuple[int, int]]] = {}
    lock = threading.Lock()

    class Ranges:
        @hookimpl
        def loaderplug_on_range_done(
            self, job: str, path: str, offset: int, length: int, retries: int
        ) -> None:
            with lock:
                ranges.setdefault(path, []).append((offset, offset + length))

    register(Ranges())
    hydrate(model, tmp_path / "local", **FAST)
    for rel, data in tree_bytes(model).items():
        spans = sorted(ranges[rel])
        assert spans[0][0] == 0 and spans[-1][1] == len(data)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert len(ranges["model-00001-of-00004.safetensors"]) > 1


def test_loaderplug_on_file_done(model: Path, tmp_path: Path, register) -> None:
    results: list[FileResult] = []

    class Files:
        @hookimpl
        def loaderplug_on_file_done(self, job: str, result: FileResult) -> None:
            results.append(result)

    register(Files())
    (model / "escape").symlink_to("../elsewhere")
    (model / "latest").symlink_to("config.json")
    hydrate(model, tmp_path / "local", check=False, **FAST)
    by_status = {(r.path, r.status) for r in results}
    assert by_status == {(rel, "restored") for rel in tree_bytes(model)} | {
        ("escape", "failed"),
        ("latest", "linked"),
    }
    results.clear()
    hydrate(model, tmp_path / "local", check=False, **FAST)
    assert {r.status for r in results if r.path != "escape"} == {"skipped"}


def test_loaderplug_on_job_done(model: Path, tmp_path: Path, register) -> None:
    reports: list[TransferReport] = []

    class Jobs:
        @hookimpl
        def loaderplug_on_job_done(self, report: TransferReport) -> None:
            reports.append(report)

    register(Jobs())
    returned = hydrate(model, tmp_path / "local", **FAST)
    assert reports == [returned]


def write_distribution(site: Path, name: str, module_body: str) -> None:
    (site / f"{name}_mod.py").write_text(module_body)
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[loaderplug]\n{name} = {name}_mod\n")


PLUGIN_MODULE = """
from pathlib import Path
from loaderplug import hookimpl

@hookimpl
def loaderplug_find_mirror(request):
    return Path("/from-entry-point") / request.name
"""


def test_entry_point_plugins_load_and_can_be_disabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_distribution(tmp_path, "fakeplug", PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    _build.cache_clear()
    try:
        request = MirrorRequest("folder", "x")
        assert plugin_manager().get_plugin("fakeplug") is not None
        assert plugin_manager().hook.loaderplug_find_mirror(request=request) == Path(
            "/from-entry-point/x"
        )
        blocked = plugin_manager(("fakeplug",))
        assert blocked.get_plugin("fakeplug") is None
        assert blocked.hook.loaderplug_find_mirror(request=request) is None
    finally:
        _build.cache_clear()


def test_broken_entry_point_names_itself_and_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_distribution(tmp_path, "brokenplug", "raise ImportError('needs libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _build.cache_clear()
    try:
        with pytest.raises(PluginError) as info:
            plugin_manager()
        assert "plugin 'brokenplug' (brokenplug_mod) failed to load: needs libfoo" in str(
            info.value
        )
        assert "LOADERPLUG_DISABLE_PLUGINS=brokenplug" in str(info.value)
    finally:
        _build.cache_clear()


def test_disabling_the_builtin_plugin_is_a_clear_error(model: Path, tmp_path: Path) -> None:
    pm = plugin_manager(("loaderplug.builtin",))
    with pytest.raises(PluginError, match="no plugin answered loaderplug_io_policy"):
        first_result(pm, "loaderplug_io_policy", path=str(model), mode="auto")


def test_an_observer_that_raises_does_not_fail_the_copy(
    model: Path, tmp_path: Path, register, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        @hookimpl
        def loaderplug_on_range_done(
            self, job: str, path: str, offset: int, length: int, retries: int
        ) -> None:
            raise RuntimeError("metrics backend down")

    register(Broken())
    report = hydrate(model, tmp_path / "local", **FAST)
    assert report.ok and tree_bytes(tmp_path / "local") == tree_bytes(model)
    assert "loaderplug_on_range_done raised" in caplog.text


def test_entry_point_scan_is_skipped_only_when_no_distribution_declares_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loaderplug import plugins

    assert plugins._declared_nowhere("loaderplug-no-such-group")
    write_distribution(tmp_path, "declared", PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not plugins._declared_nowhere("loaderplug")
    # A zip on the path could hold metadata the quick scan cannot see: ask importlib.
    monkeypatch.syspath_prepend(str(tmp_path / "archive.zip"))
    (tmp_path / "archive.zip").write_bytes(b"")
    assert not plugins._declared_nowhere("loaderplug-no-such-group")


def test_an_egg_on_the_path_is_left_to_importlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loaderplug import plugins

    (tmp_path / "legacy.egg").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "legacy.egg"))
    assert not plugins._declared_nowhere("loaderplug-no-such-group")
