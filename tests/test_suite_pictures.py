"""The benchmark suite reads its tables back to draw them: figures, spreads, failures."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "suite.py"
TABLE = """# Adaptive concurrency

| storage | setting | MiB/s (median) | min-max | failed files | retries |
|---|---|---|---|---|---|
| object store | 8 x 16 MiB | 156 | 153-159 | 0 | 87 |
| object store | 64 x 8 MiB | 201 | 200-202 | 8 | 1003 |
| object store | auto | 176 | 174-177 | 0 | 26 |

| a second table | is not drawn |
|---|---|
"""


@functools.cache
def _suite():  # type: ignore[no-untyped-def]
    """benchmarks/suite.py, loaded once (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("suite", SUITE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["suite"] = module
    spec.loader.exec_module(module)
    return module


def test_the_first_table_gives_labels_figures_and_whiskers() -> None:
    suite = _suite()
    header, rows = suite.parse_table(TABLE)
    assert header[2] == "MiB/s (median)" and len(rows) == 3
    values = [suite.number(row[2]) for row in rows]
    assert values == [156, 201, 176]
    assert suite._whiskers(header, rows, 2, values) == [[3, 1, 2], [3, 1, 1]]


def test_the_table_drawn_is_the_first_with_the_figure() -> None:
    suite = _suite()
    tables = TABLE + "| x |\n\n| case | x faster |\n|---|---|\n| load | 0.98 |\n"
    header, rows = suite.parse_table(tables, having="x faster")
    assert header == ["case", "x faster"] and rows == [["load", "0.98"]]
    with pytest.raises(ValueError, match="no table with 'speed'"):
        suite.parse_table(tables, having="speed")


def test_every_result_of_the_suite_has_the_column_it_draws() -> None:
    suite = _suite()
    results = SUITE.parent / "results"
    for bench in suite.BENCHES:
        table = results / f"{bench.name}.md"
        if table.exists():
            _, rows = suite.parse_table(table.read_text(), having=bench.figure)
            assert rows, bench.name


def test_a_spread_inside_the_cell_is_read_too() -> None:
    suite = _suite()
    header = ["reader", "total s (min-max)"]
    rows = [["loaderplug", "1.06 (0.82-1.31)"], ["probe", "0.85 (0.82-0.89)"]]
    lows, highs = suite._whiskers(header, rows, 1, [1.06, 0.85])
    assert lows == pytest.approx([0.24, 0.03]) and highs == pytest.approx([0.25, 0.04])
    # One round: no spread to draw.
    assert suite._whiskers(["reader", "s"], [["a", "5.40"]], 1, [5.4]) is None


def test_a_table_is_drawn_and_a_missing_one_skipped(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    suite = _suite()
    (tmp_path / "auto.md").write_text(TABLE)
    bench = next(b for b in suite.BENCHES if b.name == "auto")
    picture = suite.plot(bench, tmp_path)
    assert picture is not None and picture.read_bytes().startswith(b"\x89PNG")
    assert suite.plot(next(b for b in suite.BENCHES if b.name == "vllm"), tmp_path) is None
