"""No function of the package, its tests, its benchmarks or its scripts runs over 60
lines: a longer one is split into steps with names of their own, which is what a reader
(and a failing test's traceback) needs."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MOST_LINES = 60


def long_functions(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MOST_LINES:
                    where = path.relative_to(REPO)
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_of_the_package_or_its_tests_runs_over_60_lines() -> None:
    assert long_functions(REPO / "loaderplug") + long_functions(REPO / "tests") == []


def test_no_function_of_the_benchmarks_or_the_scripts_runs_over_60_lines() -> None:
    assert long_functions(REPO / "benchmarks") + long_functions(REPO / "scripts") == []
