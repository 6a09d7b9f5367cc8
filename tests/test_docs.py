"""The README stays true and short: its quick start runs, its links resolve; and the
generated parts of docs/ (settings, layers, glossary, benchmark results) are current."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def write_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("write_docs", ROOT / "scripts" / "write_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_parts_of_the_docs_are_current() -> None:
    docs = write_docs()
    for page, parts in docs.sections().items():
        text = page.read_text()
        assert docs.render(text, parts) == text, (
            f"{page.name} is stale: run `python scripts/write_docs.py`"
        )


def test_a_stale_part_is_seen() -> None:
    docs = write_docs()
    page = "before\n<!-- glossary:start -->\nold\n<!-- glossary:end -->\nafter"
    assert docs.render(page, {"glossary": "new"}) == page.replace("old", "new")


def test_quick_start_is_two_commands_that_exist() -> None:
    text = README.read_text()
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", text, re.S)
    assert block
    commands = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(commands) == 2
    assert "loaderplug demo" in commands[0]
    assert "scripts/test.sh" in commands[1]
    assert (README.parent / "scripts" / "test.sh").exists()


def test_the_readme_fits_on_a_screen_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (page.parent / target).exists(), f"{page.name} links to {target}"
    linked = set(re.findall(r"\]\(docs/([^)#]+)\)", text))
    assert linked == {p.name for p in pages[1:]}, "every docs page is linked from the README"
