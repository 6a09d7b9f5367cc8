"""A job's progress bar: on a terminal, when settings allow it, bytes landed so far."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class ProgressBar:
    def __init__(self, enabled: bool, description: str) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.description = description
        self._bar: Any = None

    def start(self, total: int) -> Callable[[int], None] | None:
        """The callback to count bytes with (None: no bar)."""
        if not self.enabled or total == 0:
            return None
        from tqdm.auto import tqdm

        self._bar = tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=self.description
        )
        return self._bar.update  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
