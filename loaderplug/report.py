"""What a job did, file by file: the value returned and printed with --json.

Names and reasons in a report come from a mirror others write: a file name may hold
a terminal's escape sequences, a carriage return or a newline that would forge or hide
report lines. :meth:`TransferReport.summary` passes each through :func:`printable`,
and so does every line the command prints (``--json`` escapes them as JSON does).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from loaderplug.types import FileResult, Status
from loaderplug.units import MiB, format_size

# What a terminal acts on or reorders rather than shows: C0 and C1 controls (escape
# sequences, carriage returns, newlines), DEL, the bidirectional marks, embeddings,
# overrides and isolates; and lone surrogates (undecodable bytes of a file name), which
# cannot even be written to a UTF-8 terminal.
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text: str) -> str:
    """``text`` safe to write to a terminal: every character it would act on instead
    of showing is written as its escape (``\\x1b``, ``\\n``, ``\\u202e``)."""
    return _UNPRINTABLE.sub(_escaped, text)


@dataclass
class TransferReport:
    """Files restored, loaded, skipped and failed, bytes moved, time taken, retries."""

    job: str
    source: str
    destination: str
    readers: int
    span_bytes: int
    results: list[FileResult] = field(default_factory=list)
    bytes_copied: int = 0
    seconds: float = 0.0
    retries: int = 0
    waited_for_lock_s: float = 0.0
    # With auto readers: the fewest and most the adaptive limit allowed.
    readers_range: tuple[int, int] | None = None

    def _with(self, status: Status) -> list[FileResult]:
        return [r for r in self.results if r.status == status]

    @property
    def restored(self) -> list[FileResult]:
        return self._with("restored")

    @property
    def loaded(self) -> list[FileResult]:
        return self._with("loaded")

    @property
    def mapped(self) -> list[FileResult]:
        return self._with("mapped")

    @property
    def bytes_mapped(self) -> int:
        """Bytes handed over as mappings: the consumer's touches read them, not the job."""
        return sum(r.size for r in self.mapped)

    @property
    def skipped(self) -> list[FileResult]:
        return self._with("skipped")

    @property
    def linked(self) -> list[FileResult]:
        return self._with("linked")

    @property
    def failed(self) -> list[FileResult]:
        return self._with("failed")

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def mib_per_s(self) -> float:
        return self.bytes_copied / MiB / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["results"] = [asdict(r) for r in self.results]
        data.update(
            restored=len(self.restored),
            loaded=len(self.loaded),
            mapped=len(self.mapped),
            bytes_mapped=self.bytes_mapped,
            skipped=len(self.skipped),
            linked=len(self.linked),
            failed=len(self.failed),
            mib_per_s=round(self.mib_per_s, 1),
        )
        return data

    @property
    def _auto(self) -> str:
        if self.readers_range is None:
            return ""
        low, high = self.readers_range
        return " (auto)" if low == high else f" (auto, {low}-{high})"

    def summary(self) -> str:
        """A few lines for people: counts, speed, and every failure with its reason."""
        loaded = f"{len(self.loaded)} loaded, " if self.loaded else ""
        loaded += f"{len(self.mapped)} mapped, " if self.mapped else ""
        lines = [
            f"{self.job} {self.source} -> {self.destination}: "
            f"{len(self.restored)} restored, {loaded}{len(self.linked)} linked, "
            f"{len(self.skipped)} skipped, {len(self.failed)} failed; "
            f"{self.bytes_copied / MiB:.1f} MiB in {self.seconds:.2f} s "
            f"({self.mib_per_s:.1f} MiB/s), {self.retries} retries, "
            f"{self.readers} readers{self._auto} x {format_size(self.span_bytes)} spans"
        ]
        if self.mapped:
            lines.append(
                f"mapped {self.bytes_mapped / MiB:.1f} MiB (through the page cache or "
                f"tmpfs): not read by loaderplug; its pages are read as they are touched"
            )
        if self.results and not (self.restored or self.linked or self.loaded) and self.ok:
            lines.append("nothing to do: every file is already up to date")
        for r in self.failed:
            errno = f" [errno {r.errno}]" if r.errno is not None else ""
            lines.append(f"  FAILED {r.path}: {r.reason}{errno}")
        # Each line whole: none of them holds a newline of its own.
        return "\n".join(printable(line) for line in lines)
