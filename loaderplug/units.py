"""Sizes: the binary units, and sizes as people write them (``64M``, ``1GiB``).

A leaf module: everything that counts bytes imports its units from here, and nothing
here imports the rest of the package.
"""

from __future__ import annotations

import re

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_SIZE = re.compile(r"^\s*(\d+)\s*(?:([kKmMgGtT])(i?[bB])?|[bB])?\s*$")
_SCALE = {"k": KiB, "m": MiB, "g": GiB, "t": TiB}


def parse_size(text: str) -> int | None:
    """``64M``, ``64MiB``, ``1GiB``, ``512k`` or plain bytes, in bytes; None when ``text``
    is not a size. Every suffix is a power of 1024."""
    match = _SIZE.match(text)
    if not match:
        return None
    number, unit = int(match.group(1)), match.group(2)
    return number * _SCALE[unit.lower()] if unit else number


def format_size(n: int) -> str:
    """``67108864`` → ``64 MiB``: the largest binary unit that divides ``n``."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
