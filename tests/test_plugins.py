"""Each hook, entry-point plugins, and LOADERPLUG_DISABLE_PLUGINS."""

from __future__ import annotations

import itertools
import sys
import threading
import types
from pathlib import Path

import pytest

from loaderplug import IOPolicy, MirrorRequest, PluginError, hookimpl, hydrate, iter_tensors, sync
from loaderplug.plugins.manager import Plugins
from loaderplug.report import FileResult, TransferReport
from loaderplug.settings import from_env
from loaderplug.types import Identity
from tests.conftest import FAST, tree_bytes


def test_loaderplug_find_mirror(tmp_path: Path, register_plugin) -> None:
    request = MirrorRequest("folder", "acme/tiny")
    assert Plugins(from_env({})).find_mirror(request) is None  # no volume configured
    (tmp_path / "vol/models/acme/tiny").mkdir(parents=True)
    # The built-in answers from the job's settings (a loader's own volume option too),
    # not from the environment.
    settings = from_env({}, mirror=str(tmp_path / "vol"))
    assert Plugins(settings).find_mirror(request) == tmp_path / "vol/models/acme/tiny"

    class Elsewhere:
        @hookimpl
        def loaderplug_find_mirror(self, request: MirrorRequest) -> Path:
            return tmp_path / "other" / request.name

    register_plugin(Elsewhere())  # a third-party plugin wins over the built-in
    assert Plugins(settings).find_mirror(request) == tmp_path / "other/acme/tiny"


def test_loaderplug_io_policy(model: Path, tmp_path: Path, register_plugin) -> None:
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

    register_plugin(Buffered())
    register_plugin(Spy())
    hydrate(model, tmp_path / "local", **FAST)
    assert seen and {p.reason for p in seen} == {"a plugin said so"}


def test_loaderplug_open_source(model: Path, tmp_path: Path, register_plugin) -> None:
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

    register_plugin(Memory())
    hydrate(model, tmp_path / "local", **FAST)
    assert tree_bytes(tmp_path / "local") == {
        rel: data.upper() for rel, data in tree_bytes(model).items()
    }


@pytest.mark.parametrize("hook", ["loaderplug_on_span_done", "loaderplug_on_range_done"])
def test_loaderplug_on_span_done(model: Path, tmp_path: Path, register_plugin, hook: str) -> None:
    """Every span lands once, in order; the hook's old name still works, with a warning."""
    spans_seen: dict[str, list[tuple[int, int]]] = {}
    lock = threading.Lock()

    def span_done(
        self: object, job: str, path: str, offset: int, length: int, retries: int
    ) -> None:
        with lock:
            spans_seen.setdefault(path, []).append((offset, offset + length))

    plugin = type("Spans", (), {hook: hookimpl(span_done)})()
    if hook == "loaderplug_on_range_done":
        with pytest.warns(DeprecationWarning, match="now loaderplug_on_span_done"):
            register_plugin(plugin)
    else:
        register_plugin(plugin)
    hydrate(model, tmp_path / "local", **FAST)
    for rel, data in tree_bytes(model).items():
        spans = sorted(spans_seen[rel])
        assert spans[0][0] == 0 and spans[-1][1] == len(data)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert len(spans_seen["model-00001-of-00004.safetensors"]) > 1


def test_loaderplug_on_file_done(model: Path, tmp_path: Path, register_plugin) -> None:
    results: list[FileResult] = []

    class Files:
        @hookimpl
        def loaderplug_on_file_done(self, job: str, result: FileResult) -> None:
            results.append(result)

    register_plugin(Files())
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


def test_loaderplug_on_job_done(model: Path, tmp_path: Path, register_plugin) -> None:
    reports: list[TransferReport] = []

    class Jobs:
        @hookimpl
        def loaderplug_on_job_done(self, report: TransferReport) -> None:
            reports.append(report)

    register_plugin(Jobs())
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


def test_loaderplug_device_backend(shards: list[Path], register_plugin) -> None:
    """The built-in answers for a CUDA device torch can use (none here); a plugin's
    backend carries a load to the device it answers for, and a device nothing can
    serve fails before any read, naming it."""
    import torch

    from loaderplug.errors import LoaderplugError
    from loaderplug.testing.fake_device import FakeDevice, FakeDevicePlugin

    settings = from_env({})
    assert Plugins(settings).device_backend("cpu") is None
    if not torch.cuda.is_available():
        assert Plugins(settings).device_backend("cuda:0") is None
        with pytest.raises(LoaderplugError, match="cannot load tensors to device 'cuda:0'"):
            next(iter_tensors(shards, "cuda:0"))
    fake = FakeDevice()
    register_plugin(FakeDevicePlugin(fake))
    assert Plugins(settings).device_backend("cuda:0") is fake
    names = [name for name, _ in iter_tensors(shards, "cuda:0", progress=False)]
    assert len(names) == 21 and fake.record_of.copies > 0


def test_entry_point_plugins_load_and_can_be_disabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_distribution(tmp_path, "fakeplug", PLUGIN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    request = MirrorRequest("folder", "x")
    # Disabled before it was ever loaded: not imported at all.
    blocked = Plugins(from_env({}, disable_plugins="fakeplug"))
    assert "fakeplug_mod" not in sys.modules
    assert blocked.find_mirror(request) is None
    assert Plugins(from_env({})).find_mirror(request) == Path("/from-entry-point/x")
    assert "fakeplug_mod" in sys.modules
    # Loaded, it stays out of the jobs that disable it.
    assert Plugins(from_env({}, disable_plugins="fakeplug")).find_mirror(request) is None


def test_broken_entry_point_names_itself_and_the_way_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_distribution(tmp_path, "brokenplug", "raise ImportError('needs libfoo')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as info:
        Plugins(from_env({}))
    assert "plugin 'brokenplug' (brokenplug_mod) failed to load: needs libfoo" in str(info.value)
    assert "LOADERPLUG_DISABLE_PLUGINS=brokenplug" in str(info.value)
    # The way out works.
    assert (
        Plugins(from_env({}, disable_plugins="brokenplug")).find_mirror(
            MirrorRequest("folder", "x")
        )
        is None
    )


def test_disabling_the_builtin_plugin_is_a_clear_error(model: Path, tmp_path: Path) -> None:
    plugins = Plugins(from_env({}, disable_plugins="loaderplug.builtin"))
    with pytest.raises(PluginError, match="no plugin answered loaderplug_io_policy"):
        plugins.io_policy(model)


def test_an_observer_that_raises_does_not_fail_the_copy(
    model: Path, tmp_path: Path, register_plugin, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken:
        @hookimpl
        def loaderplug_on_span_done(
            self, job: str, path: str, offset: int, length: int, retries: int
        ) -> None:
            raise RuntimeError("metrics backend down")

    register_plugin(Broken())
    report = hydrate(model, tmp_path / "local", **FAST)
    assert report.ok and tree_bytes(tmp_path / "local") == tree_bytes(model)
    assert "loaderplug_on_span_done raised" in caplog.text


OBSERVE_HOOKS = (
    "loaderplug_on_span_done",
    "loaderplug_on_file_done",
    "loaderplug_on_tensor_ready",
    "loaderplug_on_job_done",
)


def raising_observer(hook: str) -> object:
    """A plugin whose one observe hook raises, every time it is called."""

    def broken(**kwargs: object) -> None:
        raise RuntimeError(f"metrics backend down ({hook})")

    plugin = types.SimpleNamespace()
    # pluggy reads an implementation's arguments from its signature: take them all.
    argnames = {
        "loaderplug_on_span_done": "job, path, offset, length, retries",
        "loaderplug_on_file_done": "job, result",
        "loaderplug_on_tensor_ready": "job, path, name, tensor",
        "loaderplug_on_job_done": "report",
    }[hook]
    namespace: dict[str, object] = {"broken": broken}
    exec(f"def {hook}({argnames}): broken()", namespace)
    setattr(plugin, hook, hookimpl(namespace[hook]))
    return plugin


def run_every_job(model: Path, tmp_path: Path) -> list[TransferReport]:
    """A hydrate (twice: the second skips everything), a sync, a load and a one pass,
    each checked as a user would; returns their reports."""
    from safetensors.torch import load_file as reference

    from tests.helpers.tensors import same

    local = tmp_path / "local"
    reports = [hydrate(model, local, **FAST), hydrate(model, local, **FAST)]
    mirror = tmp_path / "mirror-copy"
    reports.append(sync(local, mirror, **FAST))
    assert all(r.ok for r in reports)
    assert (mirror / ".loaderplug-manifest.json").is_file()
    shards = sorted(model.glob("*.safetensors"))
    want = {k: v for s in shards for k, v in reference(str(s)).items()}
    for local_dir in (None, tmp_path / "onepass"):
        load = iter_tensors(shards, local_dir=local_dir, **FAST)
        got = dict(load)
        assert got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
        assert load.report is not None
        reports.append(load.report)
    assert all((tmp_path / "onepass" / s.name).read_bytes() == s.read_bytes() for s in shards)
    return reports


@pytest.mark.parametrize("hook", OBSERVE_HOOKS)
def test_an_observer_that_raises_fails_no_job_and_is_logged_once_per_job(
    hook: str, model: Path, tmp_path: Path, register_plugin, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    register_plugin(raising_observer(hook))
    with caplog.at_level("WARNING", logger="loaderplug"):
        reports = run_every_job(model, tmp_path)
    warnings = [r for r in caplog.records if f"its {hook} raised" in r.getMessage()]
    # Each job that called the hook says once that the observer failed, however often.
    jobs_that_call_it = {
        # Not the all-skipped hydrate, nor a load of small files, which the consumer's
        # thread reads itself: no reader, no span.
        "loaderplug_on_span_done": sum(
            r.bytes_copied > 0 for r in reports if r.job != "load" or r.destination
        ),
        "loaderplug_on_file_done": 5,
        "loaderplug_on_tensor_ready": 2,  # the loads
        "loaderplug_on_job_done": 5,
    }[hook]
    assert len(warnings) == jobs_that_call_it


def test_a_raising_entry_point_observer_fails_neither_a_skipping_hydrate_nor_a_sync(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = (
        "from loaderplug import hookimpl\n"
        "@hookimpl\n"
        "def loaderplug_on_file_done(job, result):\n"
        "    raise RuntimeError('metrics backend down')\n"
    )
    write_distribution(tmp_path, "metricsplug", body)
    monkeypatch.syspath_prepend(str(tmp_path))
    from loaderplug.cli.commands import main

    args = ["--chunk-bytes", "64K", "--workers", "4"]
    assert main(["hydrate", "--from", str(model), "--to", str(tmp_path / "local"), *args]) == 0
    assert main(["hydrate", "--from", str(model), "--to", str(tmp_path / "local"), *args]) == 0
    assert (
        main(["sync", "--from", str(tmp_path / "local"), "--to", str(tmp_path / "m"), *args]) == 0
    )
    assert (tmp_path / "m" / ".loaderplug-manifest.json").is_file()


def test_a_plugin_written_for_the_hooks_before_they_took_settings_still_works(
    model: Path, tmp_path: Path, register_plugin
) -> None:
    seen: list[str] = []

    class OldStyle:  # the signatures of loaderplug 0.1's hooks: no settings argument
        @hookimpl
        def loaderplug_io_policy(self, path: str, mode: str) -> IOPolicy | None:
            return None

        @hookimpl
        def loaderplug_open_source(self, path: str, policy: IOPolicy) -> None:
            seen.append(path)

        @hookimpl
        def loaderplug_on_file_done(self, job: str, result: FileResult) -> None:
            seen.append(result.status)

    register_plugin(OldStyle())
    assert hydrate(model, tmp_path / "local", **FAST).ok
    assert "restored" in seen and any(p.endswith(".safetensors") for p in seen)


def test_a_plugin_registered_at_run_time_applies_to_every_job(
    model: Path, tmp_path: Path, register_plugin
) -> None:
    calls: list[str] = []

    class Count:
        @hookimpl
        def loaderplug_on_job_done(self, report: TransferReport, settings: object) -> None:
            calls.append(report.job)

    register_plugin(Count())
    # Jobs with different settings (different disabled plugins among them) all see it.
    for n, disabled in enumerate(["", "someplug", "a,b", "c", "d", "e", "f", "g", "h", "i"]):
        hydrate(model, tmp_path / f"local{n}", disable_plugins=disabled, **FAST)
    assert calls == ["hydrate"] * 10


def test_entry_point_scan_is_skipped_only_when_no_distribution_declares_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loaderplug.plugins import manager as plugins

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
    from loaderplug.plugins import manager as plugins

    (tmp_path / "legacy.egg").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path / "legacy.egg"))
    assert not plugins._declared_nowhere("loaderplug-no-such-group")
