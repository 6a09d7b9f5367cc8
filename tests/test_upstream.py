"""The upstream seams: every name loaderplug uses in huggingface_hub, fastsafetensors and
vLLM resolves in the installed versions, and one that moves fails naming itself."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from loaderplug.integrations.upstream import Symbol, Upstream, UpstreamChanged, version_tuple
from loaderplug.integrations.upstream import fastsafetensors as fst_seam
from loaderplug.integrations.upstream import huggingface_hub as hub_seam
from loaderplug.integrations.upstream import sglang as sglang_seam
from loaderplug.integrations.upstream import vllm as vllm_seam

REPO = Path(__file__).resolve().parent.parent
SEAMS: dict[str, ModuleType] = {
    "huggingface_hub": hub_seam,
    "fastsafetensors": fst_seam,
    "vllm": vllm_seam,
    "sglang": sglang_seam,
}
# Importing vLLM takes seconds: its seams are checked in the full run only.
SLOW_TO_IMPORT = {"vllm": pytest.mark.slow("imports vLLM")}
EVERY_SYMBOL = [
    pytest.param(library, symbol, id=symbol.name, marks=SLOW_TO_IMPORT.get(library, ()))
    for library, seam in SEAMS.items()
    for symbol in seam.SYMBOLS
]
EVERY_LIBRARY = [
    pytest.param(library, marks=SLOW_TO_IMPORT.get(library, ())) for library in sorted(SEAMS)
]


def installed(library: str) -> ModuleType:
    """The seam module of ``library``, which the test needs installed."""
    pytest.importorskip(library)
    return SEAMS[library]


# -- the tables ----------------------------------------------------------------------


@pytest.mark.parametrize(("library", "symbol"), EVERY_SYMBOL)
def test_every_symbol_resolves_in_the_installed_version(library: str, symbol: Symbol) -> None:
    seam = installed(library)
    seam.UPSTREAM.get(symbol)  # raises UpstreamChanged, naming the symbol, if it is gone


@pytest.mark.parametrize("library", EVERY_LIBRARY)
def test_missing_finds_nothing_missing_in_the_installed_version(library: str) -> None:
    assert installed(library).missing() == []


@pytest.mark.parametrize("library", EVERY_LIBRARY)
def test_each_table_is_its_upstreams_and_describes_every_symbol(library: str) -> None:
    seam = SEAMS[library]
    assert seam.UPSTREAM.library == library
    assert seam.UPSTREAM.symbols == seam.SYMBOLS
    assert len({s.name for s in seam.SYMBOLS}) == len(seam.SYMBOLS)
    for symbol in seam.SYMBOLS:
        assert symbol.module.split(".")[0] == library, symbol
        assert symbol.why.strip(), symbol
    # Every name that is not public API is what the seam is for: the table must say so.
    assert any(not s.public for s in seam.SYMBOLS)


@pytest.mark.parametrize("library", EVERY_LIBRARY)
def test_the_installed_version_is_supported_and_the_record_is_ordered(library: str) -> None:
    seam = installed(library)
    assert not seam.UPSTREAM.too_old(seam.version())
    assert version_tuple(seam.NEWEST_CHECKED) >= seam.OLDEST
    major, minor = seam.OLDEST
    assert seam.UPSTREAM.too_old(f"{major}.{minor - 1}.9")
    assert not seam.UPSTREAM.too_old(f"{major}.{minor}.0")


@pytest.mark.parametrize(
    ("version", "expected"),
    [("0.32.0+cpu", (0, 32)), ("0.5rc1", (0, 5)), ("2.4.0.dev0", (2, 4)), ("1", (1,))],
)
def test_version_tuple(version: str, expected: tuple[int, ...]) -> None:
    assert version_tuple(version) == expected


# -- a name that moves -----------------------------------------------------------------


@pytest.mark.parametrize(("library", "symbol"), EVERY_SYMBOL)
def test_a_table_entry_pointing_at_a_missing_name_fails_naming_it(
    library: str, symbol: Symbol
) -> None:
    seam = installed(library)
    gone = dataclasses.replace(symbol, attr=f"{symbol.attr}_gone_in_this_version")
    with pytest.raises(UpstreamChanged) as raised:
        seam.UPSTREAM.get(gone)
    message = str(raised.value)
    assert gone.name in message
    assert f"{library} {seam.version()}" in message
    assert symbol.why in message
    assert raised.value.symbol is gone
    assert seam.UPSTREAM.find(gone) is None


@pytest.mark.parametrize(("library", "symbol"), EVERY_SYMBOL)
def test_a_module_that_moves_fails_naming_the_symbol(library: str, symbol: Symbol) -> None:
    seam = installed(library)
    moved = dataclasses.replace(symbol, module=f"{library}._moved_in_this_version")
    expected = rf"{re.escape(moved.name)} is not there \(no module {re.escape(moved.module)}\)"
    with pytest.raises(UpstreamChanged, match=expected):
        seam.UPSTREAM.get(moved)


def test_a_constant_with_another_value_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    installed("huggingface_hub")
    from huggingface_hub import _tree_cache

    monkeypatch.setattr(_tree_cache, "TREE_CACHE_FORMAT_VERSION", hub_seam.LISTING_FORMAT + 1)
    (problem,) = hub_seam.missing()
    assert "huggingface_hub._tree_cache.TREE_CACHE_FORMAT_VERSION is 2, not 1" in problem


def test_huggingface_hub_without_write_download_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    installed("huggingface_hub")
    from huggingface_hub import _local_folder

    monkeypatch.delattr(_local_folder, "write_download_metadata")
    (problem,) = hub_seam.missing()
    assert "huggingface_hub._local_folder.write_download_metadata is not there" in problem
    with pytest.raises(UpstreamChanged, match=r"_local_folder\.write_download_metadata"):
        hub_seam.write_download_metadata()


def test_the_hub_integration_refuses_to_import_without_its_snapshot_download() -> None:
    installed("huggingface_hub")
    code = """
import huggingface_hub._snapshot_download as module
del module.snapshot_download
from loaderplug.integrations.upstream import UpstreamChanged
try:
    import loaderplug.integrations.huggingface_hub
except UpstreamChanged as exc:
    print(exc)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert "huggingface_hub._snapshot_download.snapshot_download is not there" in done.stdout, (
        done.stdout + done.stderr
    )
    assert "HfApi.snapshot_download" in done.stdout  # what it was needed for


def test_fastsafetensors_without_its_copier_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    installed("fastsafetensors")
    pytest.importorskip("torch")
    from fastsafetensors.copier import registry

    from loaderplug.integrations import fastsafetensors as lp_fst

    lp_fst.uninstall()  # an earlier test may have left it installed
    monkeypatch.delattr(registry, "_copier_registry")
    (problem,) = fst_seam.missing()
    assert "fastsafetensors.copier.registry._copier_registry is not there" in problem
    with pytest.raises(UpstreamChanged, match=r"copier\.registry\._copier_registry"):
        lp_fst.install()
    assert lp_fst._original_nogds is None  # nothing was half installed


def test_fastsafetensors_without_a_nogds_copier(monkeypatch: pytest.MonkeyPatch) -> None:
    installed("fastsafetensors")
    from fastsafetensors.copier import registry

    monkeypatch.delitem(registry._copier_registry, fst_seam.NOGDS)
    (problem,) = fst_seam.missing()
    assert "_copier_registry has no 'nogds' copier registered" in problem


def test_a_copier_without_its_descriptor_fails_naming_it() -> None:
    installed("fastsafetensors")

    class Copier:  # a copier of a fastsafetensors that renamed ``fd``
        handle = 3

    with pytest.raises(UpstreamChanged, match=r"nogds\.NoGdsFileCopier\.fd is not there"):
        fst_seam.copier_fd(Copier())
    with pytest.raises(UpstreamChanged, match=r"NoGdsFileCopier\.fd"):
        fst_seam.set_copier_fd(Copier(), 4)


@pytest.mark.slow("imports vLLM")
def test_vllm_without_its_fastsafetensors_iterator(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    installed("vllm")
    installed("fastsafetensors")
    pytest.importorskip("torch")
    from vllm.model_executor.model_loader import default_loader, weight_utils

    from loaderplug.integrations import fastsafetensors as lp_fst

    iterator = weight_utils.fastsafetensors_weights_iterator
    monkeypatch.delattr(weight_utils, "fastsafetensors_weights_iterator")
    problems = vllm_seam.missing()
    assert len(problems) == 1
    assert "model_loader.weight_utils.fastsafetensors_weights_iterator" in problems[0]
    assert vllm_seam.fastsafetensors_weights_iterator() is None
    with caplog.at_level(logging.WARNING, logger="loaderplug"):
        lp_fst.hydrate_before_vllm_load()
    assert "no fastsafetensors_weights_iterator to wrap" in caplog.text
    assert default_loader.fastsafetensors_weights_iterator is iterator  # left alone


def test_vllm_without_its_base_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    installed("vllm")
    from vllm.model_executor.model_loader import base_loader

    from loaderplug.integrations import vllm as lp_vllm

    monkeypatch.delattr(base_loader, "BaseModelLoader")
    assert any("base_loader.BaseModelLoader is not there" in p for p in vllm_seam.missing())
    expected = rf"vllm {re.escape(vllm_seam.version())}: .*base_loader\.BaseModelLoader"
    with pytest.raises(UpstreamChanged, match=expected):
        lp_vllm._loader_class()


# -- the machinery, on a library made up for the test ------------------------------------


@pytest.fixture
def madeup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Upstream]:
    """``loaderplug_madeup``: a library with a module, a class, and a module whose own
    dependency is missing."""
    package = tmp_path / "loaderplug_madeup"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "3.1.4"\n')
    (package / "things.py").write_text(
        textwrap.dedent(
            """
            LIMIT = 7

            class Copier:
                def __init__(self, path):
                    self.fd = 3
                    self.path: str = path
                    self.seen == 1  # a comparison, not an assignment
            """
        )
    )
    (package / "broken.py").write_text("import loaderplug_madeup_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield Upstream("loaderplug_madeup", (3, 0), "3.1.4", ())
    finally:
        for name in [m for m in sys.modules if m.startswith("loaderplug_madeup")]:
            del sys.modules[name]


def test_instance_attributes_are_found_where_init_sets_them(madeup: Upstream) -> None:
    def member(attr: str) -> Symbol:
        return Symbol("loaderplug_madeup.things", f"Copier.{attr}", "why", instance=True)

    assert madeup.get(member("fd")).__name__ == "Copier"
    assert madeup.get(member("path")).__name__ == "Copier"
    for gone in ("seen", "handle"):
        with pytest.raises(UpstreamChanged, match=rf"Copier\.{gone} is not there"):
            madeup.get(member(gone))


def test_values_are_checked_only_where_the_table_gives_one(madeup: Upstream) -> None:
    assert madeup.get(Symbol("loaderplug_madeup.things", "LIMIT", "why")) == 7
    assert madeup.get(Symbol("loaderplug_madeup.things", "LIMIT", "why", value=7)) == 7
    with pytest.raises(UpstreamChanged, match=r"loaderplug_madeup 3\.1\.4: .*LIMIT is 7, not 8"):
        madeup.get(Symbol("loaderplug_madeup.things", "LIMIT", "why", value=8))


def test_the_error_survives_a_process_boundary(madeup: Upstream) -> None:
    symbol = Symbol("loaderplug_madeup.things", "Gone", "why")
    with pytest.raises(UpstreamChanged) as raised:
        madeup.get(symbol)
    copy = pickle.loads(pickle.dumps(raised.value))
    assert str(copy) == str(raised.value)
    assert (copy.library, copy.version, copy.symbol) == ("loaderplug_madeup", "3.1.4", symbol)


def test_a_library_that_is_not_installed_stays_an_import_error(madeup: Upstream) -> None:
    absent = Upstream("loaderplug_not_installed", (1, 0), "1.0", ())
    with pytest.raises(ImportError) as raised:
        absent.get(Symbol("loaderplug_not_installed.things", "x", "why"))
    assert not isinstance(raised.value, UpstreamChanged)
    # A module whose own dependency is missing: an install problem, not a moved name.
    with pytest.raises(ModuleNotFoundError, match="loaderplug_madeup_dependency"):
        madeup.get(Symbol("loaderplug_madeup.broken", "x", "why"))


def test_missing_lists_every_symbol_that_is_gone_and_only_those(madeup: Upstream) -> None:
    table = (
        Symbol("loaderplug_madeup.things", "LIMIT", "why"),
        Symbol("loaderplug_madeup.things", "Copier.fd", "why", instance=True),
        Symbol("loaderplug_madeup.things", "Gone", "the first gone"),
        Symbol("loaderplug_madeup.moved", "LIMIT", "the second gone"),
    )
    upstream = dataclasses.replace(madeup, symbols=table)
    problems = upstream.missing()
    assert len(problems) == 2
    assert "loaderplug_madeup.things.Gone is not there" in problems[0]
    assert "the first gone" in problems[0]
    assert "loaderplug_madeup.moved.LIMIT is not there" in problems[1]


# -- laziness ----------------------------------------------------------------------------


def test_the_seams_import_no_upstream_until_asked() -> None:
    """vLLM runs loaderplug's plugin in every process: importing it, its seams and the
    mirror's Hub layout must import none of the frameworks."""
    code = """
import sys
for name in ("torch", "huggingface_hub", "vllm", "fastsafetensors"):
    sys.modules[name] = None  # importing any of them now raises ImportError
import loaderplug.integrations.upstream.huggingface_hub
import loaderplug.integrations.upstream.fastsafetensors
import loaderplug.integrations.upstream.vllm
import loaderplug.integrations.hub.mirror
import loaderplug.integrations.volcache
import loaderplug.integrations.vllm
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "ok", done.stderr
