"""Regenerate docs/settings.md's table from the registry in loaderplug/settings.py."""

from __future__ import annotations

import re
from pathlib import Path

from loaderplug.settings import settings_table

PAGE = Path(__file__).resolve().parent.parent / "docs" / "settings.md"

text = PAGE.read_text()
start, end = "<!-- settings-table:start -->\n", "\n<!-- settings-table:end -->"
updated = re.sub(
    re.escape(start) + ".*?" + re.escape(end),
    lambda _: start + settings_table() + end,
    text,
    flags=re.S,
)
PAGE.write_text(updated)
print("docs/settings.md table", "updated" if updated != text else "already current")
