"""The edit loop (``pytest -m "not slow"``) still reaches every module of the package,
and the slow tests that tests/conftest.py marks by name still exist.

Read from the sources, not run: a module counts as reached where a test file with a
test outside the slow tier imports it, or a module so reached imports it in turn (the
helpers under tests/ too). That a reached module's code also runs there was measured
once with coverage when the tiers were drawn."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import SLOW_TESTS

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
PACKAGE = REPO / "loaderplug"

# Modules that run as programs, never imported: each is reached where the module that
# starts it is (and that module names it).
PROGRAMS = {
    "loaderplug.__main__": ("loaderplug.cli.commands", "loaderplug"),
    "loaderplug.integrations.bootstrap.sitecustomize": ("loaderplug.cli.run", "bootstrap"),
    "loaderplug.testing.slow_hydrate": ("loaderplug.testing.slowed", "slow_hydrate.py"),
}
# What only the slow tier can drive, with the reason; each must stay unreached by the
# edit loop, so that this list shrinks as soon as one is.
ONLY_SLOW = {
    "loaderplug.testing.vllm_runner": "starts vLLM",
    "loaderplug.testing.tiny_pipelines": "writes models with diffusers and sentence-transformers",
}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def source_of(name: str) -> Path | None:
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def nodes_outside(tree: ast.AST, left_out: set[str]) -> Iterator[ast.AST]:
    """The nodes of ``tree``, less those inside the functions named in ``left_out``."""
    for child in ast.iter_child_nodes(tree):
        if not (isinstance(child, ast.FunctionDef) and child.name in left_out):
            yield child
            yield from nodes_outside(child, left_out)


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def imported(path: Path, left_out: frozenset[str] = frozenset()) -> Iterator[str]:
    """Every module of the package or of tests/ that ``path`` imports, anywhere in it
    but in the functions named in ``left_out``, with the packages above each (importing a module
    imports them first)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in nodes_outside(parsed(path), set(left_out)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package
                base = ".".join([*package[: len(package) - node.level + 1], base]).strip(".")
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        for name in names:
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                if parts[0] in ("loaderplug", "tests") and source_of(".".join(parts[:end])):
                    yield ".".join(parts[:end])


def slow_aliases(tree: ast.Module) -> set[str]:
    """Names a module binds to a ``slow`` mark (``SLOW_TRIAL = pytest.mark.slow(...)``)."""
    return {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign) and ast.unparse(node.value).startswith("pytest.mark.slow")
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def split_by_tier(path: Path) -> tuple[list[str], list[str]]:
    """The file's tests outside the slow tier, and those in it: marked ``slow`` by the
    file, by the test, or by SLOW_TESTS (by its id without parameters)."""
    tree = parsed(path)
    aliases = slow_aliases(tree)
    whole_file = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and "pytest.mark.slow" in ast.unparse(node.value)
        for node in tree.body
    )
    relative = path.relative_to(REPO).as_posix()
    fast: list[str] = []
    slow: list[str] = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
            continue
        marks = [ast.unparse(d) for d in node.decorator_list]
        marked = any(m.startswith("pytest.mark.slow") or m in aliases for m in marks)
        by_name = f"{relative}::{node.name}" in SLOW_TESTS
        (slow if whole_file or marked or by_name else fast).append(node.name)
    return fast, slow


def reached_by_the_edit_loop() -> set[str]:
    reached = {"tests.conftest"}
    todo = list(imported(TESTS / "conftest.py"))
    for path in sorted(TESTS.glob("test_*.py")):
        fast, slow = split_by_tier(path)
        if fast:  # the file's own imports, and those of its tests outside the slow tier
            reached.add(module_name(path))
            todo.extend(imported(path, left_out=frozenset(slow)))
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        path = source_of(name)
        if path is not None:
            todo.extend(imported(path))
    return reached


def test_every_module_of_the_package_is_reached_by_a_test_outside_the_slow_tier() -> None:
    reached = reached_by_the_edit_loop()
    for program, (starter, named_as) in PROGRAMS.items():
        starter_source = source_of(starter)
        assert starter_source is not None and named_as in starter_source.read_text(), program
        if starter in reached:
            reached.add(program)
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    unreached = sorted(modules - reached - set(ONLY_SLOW))
    assert unreached == [], "no test outside the slow tier imports these"
    assert sorted(reached & set(ONLY_SLOW)) == [], "reached now: take them off ONLY_SLOW"


def test_every_test_marked_slow_by_name_exists() -> None:
    for node_id in SLOW_TESTS:
        file, name = node_id.split("[")[0].split("::")
        tree = ast.parse((REPO / file).read_text())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{node_id}: no such test (take it off SLOW_TESTS)"
