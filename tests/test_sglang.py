"""SGLang: loaderplug's general plugin, as SGLang loads it (its entry-point group, its
own ``load_plugins`` and ``HookRegistry``; SGLang installed without its dependencies,
as far as that goes here: it needs CUDA to run), wrapping the default loader's
safetensors weight iterators."""

from __future__ import annotations

import ast
import importlib.util
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.plugins.hook_registry")
pytest.importorskip("torch")

from sglang.srt.plugins.hook_registry import HookRegistry

from loaderplug.integrations.upstream import sglang as seam
from tests.helpers import sglang_loader
from tests.helpers.tensors import reference, same

STAND_IN = "tests.helpers.sglang_loader.safetensors_weights_iterator"


@pytest.fixture
def registry() -> object:
    """SGLang's registry as the test found it, put back afterwards."""
    hooks, patched = dict(HookRegistry._hooks), set(HookRegistry._patched)
    original = sglang_loader.safetensors_weights_iterator
    yield HookRegistry
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(hooks)
    HookRegistry._patched = patched
    sglang_loader.safetensors_weights_iterator = original


def test_sglang_loads_loaderplugs_plugin_from_its_entry_point_group(registry: object) -> None:
    from sglang.srt import plugins

    (ours,) = [
        e for e in entry_points(group=plugins.GENERAL_PLUGINS_GROUP) if e.name == "loaderplug"
    ]
    assert ours.value == "loaderplug.integrations.sglang:register"
    plugins._plugins_loaded = False
    plugins.load_plugins()  # SGLang's own: runs every general plugin, then applies hooks
    for target in seam.TARGETS:
        kinds = [(kind.value, hook.__name__) for kind, hook, _ in HookRegistry._hooks[target]]
        assert ("around", "weights_through_loaderplug") in kinds


def test_the_targets_are_the_iterators_sglangs_loader_calls() -> None:
    """SGLang's loader module needs its whole stack to import: its source says the same."""
    top = importlib.util.find_spec("sglang")
    assert top is not None and top.submodule_search_locations
    source = Path(top.submodule_search_locations[0]).parent / (
        seam.LOADER_MODULE.replace(".", "/") + ".py"
    )  # found, not imported: importing its package needs SGLang's whole stack
    loader = ast.parse(source.read_text())
    imported = {
        alias.name
        for node in ast.walk(loader)
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("weight_utils")
        for alias in node.names
    }
    called = {n.func.id for n in ast.walk(loader) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Name)}  # fmt: skip
    utils = source.with_name("weight_utils.py")
    defined = {n.name: n for n in ast.walk(ast.parse(utils.read_text()))
               if isinstance(n, ast.FunctionDef)}  # fmt: skip
    for target in seam.TARGETS:
        name = target.rsplit(".", 1)[1]
        assert name in imported and name in called, name
        assert defined[name].args.args[0].arg == "hf_weights_files", name


def wrapped(registry: object) -> None:
    """The stand-in iterator wrapped by loaderplug's hook, through SGLang's registry."""
    from loaderplug.integrations.sglang import weights_through_loaderplug

    seam.register_around()(STAND_IN, weights_through_loaderplug)
    HookRegistry.apply_hooks()


def test_with_a_mirror_the_weights_stream_through_loaderplug_in_one_pass(
    registry: object, shards: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    volume = shards[0].parent
    monkeypatch.setenv("LOADERPLUG_MIRROR", str(volume))
    monkeypatch.setenv("LOADERPLUG_LOCAL_COPIES", str(tmp_path / "local"))
    monkeypatch.setenv("LOADERPLUG_PROGRESS", "0")
    wrapped(registry)
    sglang_loader.CALLS.clear()
    got = dict(sglang_loader.safetensors_weights_iterator([str(s) for s in shards]))
    assert sglang_loader.CALLS == []  # SGLang's own reader never ran
    assert sorted(got) == sorted(reference(shards))
    assert all(same(got[n], t) for n, t in reference(shards).items())
    (copy,) = (tmp_path / "local").iterdir()  # the local copy, from the same reads
    for s in shards:
        assert (copy / s.name).read_bytes() == s.read_bytes()


def test_without_a_mirror_sglangs_own_iterator_runs_as_called(
    registry: object, shards: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOADERPLUG_MIRROR", raising=False)
    wrapped(registry)
    sglang_loader.CALLS.clear()
    got = dict(sglang_loader.safetensors_weights_iterator([str(shards[0])], disable_mmap=True))
    assert [([str(shards[0])], {"disable_mmap": True})] == sglang_loader.CALLS
    assert all(same(got[n], t) for n, t in reference(shards[:1]).items())
