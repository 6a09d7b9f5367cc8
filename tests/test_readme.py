"""The README stays true: its settings table is the registry's, its quick start runs."""

from __future__ import annotations

import re
from pathlib import Path

from loaderplug.settings import settings_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_settings_table_is_generated_from_the_registry() -> None:
    text = README.read_text()
    match = re.search(
        r"<!-- settings-table:start -->\n(.*?)\n<!-- settings-table:end -->", text, re.S
    )
    assert match, "the README lost its settings-table markers"
    assert match.group(1) == settings_table(), (
        "README settings table is stale: run `python scripts/write_settings_table.py`"
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
