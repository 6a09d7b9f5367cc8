"""The package's modules import one another without a cycle, and in layer order.

Every import counts: at the top of a module, inside a function, or under
``TYPE_CHECKING``. A cycle that only a lazy import keeps from failing at start-up still
means two modules that cannot be understood, tested or changed apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

from loaderplug.glossary import LAYERS, SUBLAYERS

REPO = Path(__file__).resolve().parent.parent
# Where the package lives.
ROOTS = {"loaderplug": REPO / "loaderplug"}


def package_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules that ``name`` imports, explicitly (a package's ``__init__``
    is only counted when it is itself what is imported from)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the submodule; ``from pkg import name``
            # imports the package itself.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each given as
    one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(a_cycle(sorted(group), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def a_cycle(group: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    paths = [[start]]
    seen = {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph[path[-1]] & members):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    raise AssertionError("a strongly connected group always holds a cycle")


def test_the_package_has_no_import_cycle() -> None:
    modules = package_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_cycle_finder_names_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_lazy_imports_are_seen(tmp_path: Path) -> None:
    module = tmp_path / "volcache.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import hub_mirror\n"
        "if TYPE_CHECKING:\n"
        "    from loaderplug.report import TransferReport\n"
        "def f():\n"
        "    from loaderplug import settings\n"
    )
    modules = {
        "loaderplug.integrations.volcache": module,
        "loaderplug.integrations.hub_mirror": module,
        "loaderplug.report": module,
        "loaderplug.settings": module,
        "loaderplug": module,
    }
    assert imports_of("loaderplug.integrations.volcache", module, modules) == {
        "loaderplug.integrations.hub_mirror",
        "loaderplug.report",
        "loaderplug.settings",
    }


def layer_of(module: str) -> int | None:
    """The layer a module belongs to; None for the package's façade (``__init__`` and
    ``__main__``), which may import anything."""
    parts = module.split(".")
    if module in ("loaderplug", "loaderplug.__main__"):
        return None
    if len(parts) == 2 and parts[1] not in LAYERS:
        return LAYERS.index("vocabulary")
    return LAYERS.index(parts[1])


def test_every_module_is_in_a_layer() -> None:
    for name in package_modules():
        parts = name.split(".")
        assert len(parts) < 3 or parts[1] in LAYERS, f"{name} is in no layer"


def test_no_layer_imports_a_higher_one() -> None:
    modules = package_modules()
    wrong = []
    for name, path in sorted(modules.items()):
        own = layer_of(name)
        if own is None:
            continue
        for imported in sorted(imports_of(name, path, modules)):
            theirs = layer_of(imported)
            if theirs is None or theirs > own:
                wrong.append(f"{name} ({LAYERS[own]}) imports {imported}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_root_holds_only_the_vocabulary_and_the_public_api() -> None:
    root = {p.stem for p in (REPO / "loaderplug").glob("*.py")}
    assert root == {
        "__init__",
        "__main__",
        "errors",
        "glossary",
        "report",
        "settings",
        "types",
        "units",
    }


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "spans.py"
    module.write_text("from loaderplug.jobs import runner\n")
    modules = {"loaderplug.engine.spans": module, "loaderplug.jobs.runner": module}
    (imported,) = imports_of("loaderplug.engine.spans", module, modules)
    own, theirs = layer_of("loaderplug.engine.spans"), layer_of(imported)
    assert own is not None and theirs is not None and theirs > own


def sublayer_of(module: str) -> tuple[str, int] | None:
    """A module's layer and its rank among the layer's sub-packages (the layer's own
    modules, and sub-packages not listed, rank above them all); None outside a layer
    with sub-packages."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] not in SUBLAYERS:
        return None
    order = SUBLAYERS[parts[1]]
    return parts[1], order.index(parts[2]) if parts[2] in order else len(order)


def test_no_sub_package_imports_a_higher_one() -> None:
    modules = package_modules()
    wrong = []
    for name, path in sorted(modules.items()):
        own = sublayer_of(name)
        if own is None:
            continue
        for imported in sorted(imports_of(name, path, modules)):
            theirs = sublayer_of(imported)
            if theirs is not None and theirs[0] == own[0] and theirs[1] > own[1]:
                wrong.append(f"{name} imports {imported}")
    assert not wrong, "imports against the sub-packages' order:\n" + "\n".join(wrong)


def test_every_listed_sub_package_exists_and_says_what_it_is() -> None:
    for layer, subs in SUBLAYERS.items():
        for sub in subs:
            init = REPO / "loaderplug" / layer / sub / "__init__.py"
            assert init.is_file(), f"{layer}/{sub} is listed but is not a package"
            assert ast.get_docstring(ast.parse(init.read_text())), f"{init} has no purpose"


def test_the_sub_package_check_sees_an_upward_import() -> None:
    low = sublayer_of("loaderplug.tensors.format.header")
    high = sublayer_of("loaderplug.tensors.delivery.tensor_sinks")
    top = sublayer_of("loaderplug.tensors.reader")
    assert low is not None and high is not None and top is not None
    assert low[1] < high[1] < top[1]
