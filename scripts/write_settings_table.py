"""Regenerate the README's settings table from the registry in loaderplug/settings.py."""

from __future__ import annotations

import re
from pathlib import Path

from loaderplug.settings import settings_table

README = Path(__file__).resolve().parent.parent / "README.md"

text = README.read_text()
start, end = "<!-- settings-table:start -->\n", "\n<!-- settings-table:end -->"
updated = re.sub(
    re.escape(start) + ".*?" + re.escape(end),
    lambda _: start + settings_table() + end,
    text,
    flags=re.S,
)
README.write_text(updated)
print("README settings table", "updated" if updated != text else "already current")
