"""Regenerate the generated parts of docs/: the settings table (from the registry in
loaderplug/settings.py), the glossary and the layers (from loaderplug/glossary.py and
each layer's package docstring), and the benchmark results (from benchmarks/results/).

Each generated part sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``;
tests/test_docs.py checks that every one is current.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from loaderplug.glossary import LAYERS, SUBLAYERS, TERMS
from loaderplug.settings import settings_table

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS = (
    "hub_outage",
    "hydrate",
    "auto",
    "load",
    "onepass",
    "hub",
    "vllm",
    "vllm_tp",
    "fst",
    "iopolicy",
    "scale",
    "crash",
    "multihost",
    "heartbeat",
    "owned",
    "objectstore",
    "objectstore_clients",
)


def glossary_table() -> str:
    rows = ["| word | means |", "|---|---|"]
    return "\n".join(rows + [f"| {word} | {meaning} |" for word, meaning in TERMS.items()])


def _package_row(package: str) -> str:
    """A package's row: its folder, the first paragraph of its docstring, its modules."""
    doc = importlib.import_module("loaderplug." + package.replace("/", ".")).__doc__ or ""
    first = " ".join(doc.split("\n\n")[0].split()).split(": ")[-1]
    summary = re.sub(r":\w+:`\.?([^`]+)`|``([^`]+)``", r"`\1\2`", first)
    folder = ROOT / "loaderplug" / package
    modules = sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    names = ", ".join(f"`{m}`" for m in modules)
    return f"| `loaderplug/{package}/` | {summary[0].upper()}{summary[1:]} | {names} |"


def layers_table() -> str:
    rows = [
        "| layer | what it is | modules |",
        "|---|---|---|",
        "| `loaderplug/` (the root) | The public API (`__init__`) and the vocabulary. | "
        "`types`, `units`, `settings`, `errors`, `report`, `glossary` |",
    ]
    for layer in LAYERS[1:]:  # the vocabulary is the root's row
        rows.append(_package_row(layer))
        rows += [_package_row(f"{layer}/{sub}") for sub in SUBLAYERS.get(layer, ())]
    return "\n".join(rows)


def results_of(name: str) -> str:
    """A benchmark's results page without its title, its headings one level down."""
    lines = (RESULTS / f"{name}.md").read_text().strip().splitlines()
    body = lines[1:] if lines and lines[0].startswith("# ") else lines
    return "\n".join(f"#{line}" if line.startswith("#") else line for line in body).strip()


def headline() -> str:
    """The README's table: the 4-shard hydrate, each contender's MiB/s and its ratio to
    ``cp -r``, from the hydrate benchmark's results."""
    rows = ["| contender | MiB/s | x cp -r |", "|---|---|---|"]
    for line in (RESULTS / "hydrate.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 5 and cells[0] == "4 shards" and not cells[1].startswith("probe"):
            rows.append(f"| {cells[1]} | {cells[2]} | {cells[5]} |")
    return "\n".join(rows)


def sections() -> dict[Path, dict[str, str]]:
    return {
        ROOT / "README.md": {"headline": headline()},
        DOCS / "settings.md": {"settings-table": settings_table()},
        DOCS / "design.md": {"layers": layers_table(), "glossary": glossary_table()},
        DOCS / "benchmarks.md": {f"results-{n}": results_of(n) for n in BENCHMARKS},
    }


def render(text: str, parts: dict[str, str]) -> str:
    for name, content in parts.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        pattern = re.escape(start) + ".*?" + re.escape(end)
        match = re.search(pattern, text, re.S)
        if match is None:
            raise SystemExit(f"a docs page lost its {name} markers")
        text = text[: match.start()] + f"{start}\n{content}\n{end}" + text[match.end() :]
    return text


def main() -> None:
    for page, parts in sections().items():
        text = page.read_text()
        updated = render(text, parts)
        page.write_text(updated)
        print(page.relative_to(ROOT), "updated" if updated != text else "already current")


if __name__ == "__main__":
    main()
