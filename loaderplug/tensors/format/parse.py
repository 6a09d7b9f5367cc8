"""A safetensors header's JSON checked as serde_json reads it, over its bytes, without
building it.

:mod:`loaderplug.tensors.format.header` decodes a tensor's entry with Python's json where the
entry is small; whatever is large (an unknown field of a million numbers, a shape of a
million dimensions, metadata of a million keys, a name of megabytes) or nested is walked
here, token by token over the header's bytes, so no Python object is ever made for a
value nobody uses and memory stays bounded by the header, whatever it holds. The rules
are serde_json's, the same :mod:`~loaderplug.tensors.format.header` enforces on what it decodes:
JSON whitespace only; strings without raw control characters or lone surrogate escapes;
numbers within a 64-bit float's range; no ``NaN``/``Infinity``; nothing nested deeper
than :data:`MAX_DEPTH`. The bytes are valid UTF-8 (the caller checked them first).

Runs of plain values (numbers that cannot overflow, strings without escapes, literals,
empty containers) are skipped by a regular expression a thousand at a time; the Python
loop runs only at containers and escapes. No pattern repeats a group without a bound
(the regular expression engine keeps state for each repetition of a group, which on a
header of megabytes would take gigabytes), and each has one way to match each byte, so
none backtracks more than linearly on a header built to make it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from loaderplug.errors import FormatError

# serde_json's recursion limit: arrays and objects nested deeper than this are refused.
MAX_DEPTH = 127

_WS = re.compile(rb"[ \t\n\r]*")
_STRING_RUN = re.compile(rb'[^"\\\x00-\x1f]*')
_STRING_ESCAPE = re.compile(rb'\\(?:["\\/bfnrt]|(u)[0-9a-fA-F]{4})')
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# A number that no float overflows on: no exponent, at most 308 integer digits.
_SAFE_NUMBER = rb"-?(?:0|[1-9][0-9]{0,307})(?:\.[0-9]+)?(?![0-9.eE])"
_PLAIN_STRING = rb'"[^"\\\x00-\x1f]*"'
_SCALAR = rb"(?:" + _PLAIN_STRING + rb"|" + _SAFE_NUMBER + rb"|true|false|null)"
_W = rb"[ \t\n\r]*"
# Values a run pattern skips at once (plain values, or small containers), and items a
# small container may hold: bounds on the engine's state for one match, a few hundred
# bytes for each repetition of a group.
RUN = 1024
NESTED_RUN = 8
SMALL_CONTAINER = 16


def _small_container(value: bytes) -> bytes:
    """An array of up to :data:`SMALL_CONTAINER` ``value``, or an object of as many
    members with such values."""
    member = _PLAIN_STRING + _W + rb":" + _W + value
    items = [
        rb"(?:" + item + rb"(?:" + _W + rb"," + _W + item + rb"){0,%d})?" % SMALL_CONTAINER
        for item in (value, member)
    ]
    array = rb"\[" + _W + items[0] + _W + rb"\]"
    return rb"(?:" + array + rb"|\{" + _W + items[1] + _W + rb"\})"


def _runs(value: bytes, count: int) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    """Patterns skipping ``value,`` in an array and ``"key": value,`` in an object."""
    array = rb"(?:" + _W + value + _W + rb",){0,%d}" % count
    member = rb"(?:" + _W + _PLAIN_STRING + _W + rb":" + _W + value + _W + rb",){0,%d}" % count
    return re.compile(array), re.compile(member)


# What runs skip, by how deep their values sit: plain values, then small containers two
# levels deep, one level at the limit (holding no container), none past it.
_ONE_LEVEL = rb"(?:" + _SCALAR + rb"|" + _small_container(_SCALAR) + rb")"
_TWO_LEVELS = rb"(?:" + _SCALAR + rb"|" + _small_container(_ONE_LEVEL) + rb")"
_PLAIN_RUNS = _runs(_SCALAR, RUN)
_RUNS = (
    (_PLAIN_RUNS, _runs(_TWO_LEVELS, NESTED_RUN)),
    (_PLAIN_RUNS, _runs(_ONE_LEVEL, NESTED_RUN)),
    (_PLAIN_RUNS,),
)
_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)")
_PAIR = rb"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([0-9a-fA-F]{4})"
_UNESCAPE = re.compile(_PAIR + rb"|\\u([0-9a-fA-F]{4})|\\(.)")
_SIMPLE_ESCAPES = {b'"': b'"', b"\\": b"\\", b"/": b"/", b"b": b"\b", b"f": b"\f"}
_SIMPLE_ESCAPES.update({b"n": b"\n", b"r": b"\r", b"t": b"\t"})
_CLOSE = {ord("["): ord("]"), ord("{"): ord("}")}


class Scanner:
    """The header ``raw`` of the file ``path``, read a token at a time."""

    def __init__(self, path: str, raw: bytes) -> None:
        self.path = path
        self.raw = raw

    def error(self, what: str) -> FormatError:
        return FormatError(f"{self.path}: header is not valid JSON ({what})")

    def too_deep(self) -> FormatError:
        return FormatError(
            f"{self.path}: header JSON nests deeper than the {MAX_DEPTH} levels safetensors reads"
        )

    def ws(self, pos: int) -> int:
        return _match(_WS, self.raw, pos).end()

    def byte(self, pos: int) -> int:
        """The byte at ``pos``, -1 at the end."""
        return self.raw[pos] if pos < len(self.raw) else -1

    def expect(self, pos: int, char: bytes) -> int:
        """Past ``char`` at ``pos`` (whitespace before it skipped)."""
        pos = self.ws(pos)
        if self.raw[pos : pos + 1] != char:
            raise self.error(f"expected {char.decode()!r} at byte {pos}")
        return pos + 1

    def string(self, pos: int) -> int:
        """The end of the string token at ``pos``, checked (escapes, surrogates)."""
        if self.byte(pos) != ord('"'):
            raise self.error(f"expected a string at byte {pos}")
        at = pos + 1
        unicode_escapes = False
        while True:
            at = _match(_STRING_RUN, self.raw, at).end()
            char = self.byte(at)
            if char == ord('"'):
                break
            escape = _STRING_ESCAPE.match(self.raw, at) if char == ord("\\") else None
            if escape is None:
                raise self.error(f"the string at byte {pos} is malformed or unterminated")
            unicode_escapes = unicode_escapes or escape[1] is not None
            at = escape.end()
        if unicode_escapes:
            self._check_surrogates(pos, at + 1)
        return at + 1

    def _check_surrogates(self, begin: int, end: int) -> None:
        """A high surrogate escape must be followed at once by a low one, and a low one
        preceded by a high one (as Python pairs them, and serde requires)."""
        pending = -1  # where the escape after an unpaired high surrogate would start
        for match in _ESCAPE.finditer(self.raw, begin, end):
            code = int(match[1], 16) if match[1] else -1
            if 0xDC00 <= code <= 0xDFFF and pending == match.start():
                pending = -1
            elif pending >= 0 or 0xDC00 <= code <= 0xDFFF:
                break
            elif 0xD800 <= code <= 0xDBFF:
                pending = match.end()
        else:
            if pending < 0:
                return
        raise FormatError(
            f"{self.path}: header JSON has a lone surrogate escape in {self.show(begin, end)}"
        )

    def text(self, begin: int, end: int) -> bytes:
        """The UTF-8 bytes of the (checked) string token ``[begin, end)``, unescaped."""
        if self.raw.find(b"\\", begin, end) < 0:
            return self.raw[begin + 1 : end - 1]
        # Piece by piece into one buffer: re.sub would hold a piece per escape at once.
        out = bytearray()
        view = memoryview(self.raw)
        at = begin + 1
        for escape in _UNESCAPE.finditer(self.raw, at, end - 1):
            out += view[at : escape.start()]
            out += _unescaped(escape)
            at = escape.end()
        out += view[at : end - 1]
        return bytes(out)

    def text_view(self, begin: int, end: int) -> bytes | memoryview:
        """:meth:`text`, without a copy where the token holds no escape."""
        if self.raw.find(b"\\", begin, end) < 0:
            return memoryview(self.raw)[begin + 1 : end - 1]
        return self.text(begin, end)

    def show(self, begin: int, end: int) -> str:
        """The text of ``[begin, end)`` for a message, cut short: it may be huge."""
        shown = self.raw[begin : min(end, begin + 40)].decode("utf-8", "replace")
        return shown + ("..." if end - begin > 40 else "")

    def scalar(self, pos: int) -> int:
        """The end of the string, number or literal at ``pos``."""
        char = self.byte(pos)
        if char == ord('"'):
            return self.string(pos)
        for word in (b"true", b"false", b"null"):
            if self.raw.startswith(word, pos):
                return pos + len(word)
        for word in (b"NaN", b"Infinity", b"-Infinity"):
            if self.raw.startswith(word, pos):
                raise self.error(f"{word.decode()} is not JSON")
        match = _NUMBER.match(self.raw, pos)
        if match is None or match.end() == pos:
            raise self.error(f"expected a value at byte {pos}")
        token = match.group()
        digits = len(token.partition(b".")[0].lstrip(b"-"))
        if (digits > 308 or b"e" in token or b"E" in token) and float(token) in (
            float("inf"),
            float("-inf"),
        ):
            raise self.error(
                f"number {self.show(pos, match.end())} is out of range of a 64-bit float"
            )
        return match.end()

    def skip_value(self, pos: int, depth: int) -> int:
        """The end of the value at ``pos`` (whitespace before it skipped), which sits at
        ``depth`` (the header's object is at 1), checked whole without being built."""
        closers = bytearray()  # what closes each container the walk is in
        while True:
            pos = self.ws(pos)
            char = self.byte(pos)
            if char in _CLOSE:
                if depth + len(closers) > MAX_DEPTH:
                    raise self.too_deep()
                pos = self.ws(pos + 1)
                if self.byte(pos) == _CLOSE[char]:
                    pos += 1
                else:
                    closers.append(_CLOSE[char])
                    pos = self._run(pos, depth + len(closers), closers[-1] == ord("}"))
                    continue
            else:
                pos = self.scalar(pos)
            pos = self._after_value(pos, depth, closers)
            if not closers:
                return pos

    def _after_value(self, pos: int, depth: int, closers: bytearray) -> int:
        """Past the commas and closers after a value: at the next value, or at the end
        of the outermost container (``closers`` then empty)."""
        while closers:
            pos = self.ws(pos)
            char = self.byte(pos)
            if char == ord(","):
                return self._run(pos + 1, depth + len(closers), closers[-1] == ord("}"))
            if char != closers[-1]:
                raise self.error(f"expected ',' or {chr(closers[-1])!r} at byte {pos}")
            closers.pop()
            pos += 1
        return pos

    def _run(self, pos: int, inner: int, in_object: bool) -> int:
        """Past the plain values (members, in an object) starting at ``pos`` in a
        container whose values sit at ``inner``, then past the next key and its colon."""
        runs = [pair[in_object] for pair in _RUNS[min(2, max(0, inner - MAX_DEPTH + 1))]]
        skipped = -1
        while skipped != pos:
            skipped = pos
            for run in runs:
                while (after := _match(run, self.raw, pos).end()) > pos:
                    pos = after
        if in_object:
            pos = self.ws(pos)
            if self.byte(pos) != ord('"'):
                raise self.error(f"expected a key at byte {pos}")
            pos = self.expect(self.string(pos), b":")
        return pos

    def members(self, pos: int, depth: int) -> Iterator[tuple[int, int, int, int]]:
        """Each member of the object at ``pos`` (its ``{``), which sits at ``depth``:
        its key token's and its value's ``[begin, end)``."""
        pos = self.ws(pos + 1)
        if self.byte(pos) == ord("}"):
            return
        while True:
            pos = self.ws(pos)
            if self.byte(pos) != ord('"'):
                raise self.error(f"expected a key at byte {pos}")
            key_end = self.string(pos)
            begin = self.ws(self.expect(key_end, b":"))
            end = self.skip_value(begin, depth + 1)
            yield pos, key_end, begin, end
            pos = self.ws(end)
            if self.byte(pos) == ord("}"):
                return
            pos = self.expect(pos, b",")

    def elements(self, pos: int, depth: int) -> Iterator[tuple[int, int]]:
        """Each element of the array at ``pos`` (its ``[``), which sits at ``depth``:
        its ``[begin, end)``."""
        pos = self.ws(pos + 1)
        if self.byte(pos) == ord("]"):
            return
        while True:
            begin = self.ws(pos)
            end = self.skip_value(begin, depth + 1)
            yield begin, end
            pos = self.ws(end)
            if self.byte(pos) == ord("]"):
                return
            pos = self.expect(pos, b",")


def _match(pattern: re.Pattern[bytes], raw: bytes, pos: int) -> re.Match[bytes]:
    """``pattern`` (one that matches the empty string) matched at ``pos``."""
    match = pattern.match(raw, pos)
    assert match is not None
    return match


def _unescaped(match: re.Match[bytes]) -> bytes:
    high, low, single, other = match.groups()
    if high is not None:
        code_high, code_low = int(high, 16), int(low, 16)
        if 0xDC00 <= code_low <= 0xDFFF:
            code = 0x10000 + ((code_high - 0xD800) << 10) + (code_low - 0xDC00)
            return chr(code).encode()
        # Not a pair: checked strings never hold a lone surrogate, so this cannot be.
        return chr(code_high).encode("utf-8", "surrogatepass") + chr(code_low).encode()
    if single is not None:
        return chr(int(single, 16)).encode("utf-8", "surrogatepass")
    return _SIMPLE_ESCAPES[other]
