"""The README stays true and short: its quick start runs, its links resolve, and the
settings table in docs/ is the registry's."""

from __future__ import annotations

import re
from pathlib import Path

from loaderplug.settings import settings_table

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SETTINGS_PAGE = ROOT / "docs" / "settings.md"


def test_settings_table_is_generated_from_the_registry() -> None:
    text = SETTINGS_PAGE.read_text()
    match = re.search(
        r"<!-- settings-table:start -->\n(.*?)\n<!-- settings-table:end -->", text, re.S
    )
    assert match, "docs/settings.md lost its settings-table markers"
    assert match.group(1) == settings_table(), (
        "the settings table is stale: run `python scripts/write_settings_table.py`"
    )


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
