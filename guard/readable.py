r"""What a client reads in generated text once it decodes the JSON in it, for the output guard.

Tool-call arguments and structured output (`json_object`, `json_schema`, named and required tool calls) reach
the client as JSON, and the client reads them decoded: the model writes `{"x": "\u0062\u006f\u006d\u0062"}`,
the client's `json.loads` reads "bomb". The gateway itself re-serialises parsed calls (vLLM's Hermes parser,
`required` items) with the escapes resolved. Many apps also decode plain `content` that a prompt asked to be
JSON. So the output guard reads the output twice where decoding changes it: as generated, and decoded.

`decode_escapes(text)` resolves every JSON escape (`\"`, `\\`, `\/`, `\b`, `\f`, `\n`, `\r`, `\t`, `\uXXXX`
with surrogate pairs) wherever it stands. It needs no JSON parse and no string state: outside JSON strings a
backslash is not valid JSON, so resolving escapes everywhere reads valid JSON exactly as a decoder does and
only ever adds text to check elsewhere.

`Reading` is that decoded view of a stream, fed piece by piece as the engine generates, and cut into bounded,
overlapping windows for the moderator's checks (`guard.moderator`). Its windows are laid out in decoded
characters, not in the generated tokens of the raw reading's windows: an escaped phrase is about six times
longer as written than as read ("bomb" is 24 characters written), so a phrase that fits any decoded window
may span several raw ones. A window in which no escape was resolved is plain text that the raw reading
already checks, and is left out, so text without escapes costs nothing more.
"""

from __future__ import annotations

import bisect
import re

from guard.windows import window_starts

__all__ = ["CHARS_PER_TOKEN", "Reading", "decode_escapes"]

# Left to right, a pair of backslashes is consumed as one escape, so `\\u0062` is a backslash and "u0062".
_ESCAPE = re.compile(
    r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})"  # a surrogate pair
    r"|\\u([0-9a-fA-F]{4})"
    r'|\\(["\\/bfnrt])'
)
# The start of an escape that the text seen so far cuts off at its end (`\`, `\u`, `\u0`, ... `\u006`).
_CUT_OFF = re.compile(r"\\(?:u[0-9a-fA-F]{0,3})?\Z")
_PAIR = 12  # characters in a surrogate pair, the longest escape
_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# Where no pair completes a surrogate (json.loads would keep it): a lone surrogate is not text a tokenizer
# takes, and a guard that cannot encode its input must not be the attacker's way to its fail mode.
_REPLACEMENT = "\ufffd"
# The decoded windows' unit: a phrase of `n` generated tokens is read as about `CHARS_PER_TOKEN * n`
# characters of ordinary text (English BPE vocabularies average about four).
CHARS_PER_TOKEN = 4


def _resolve(match: re.Match[str]) -> str:
    high, low, code, simple = match.groups()
    if high is not None:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + (int(low, 16) - 0xDC00))
    if code is not None:
        point = int(code, 16)
        return _REPLACEMENT if 0xD800 <= point <= 0xDFFF else chr(point)
    return _SIMPLE[simple]


def _high_surrogate(match: re.Match[str]) -> bool:
    """A lone `\\uD800`-`\\uDBFF`: the start of a pair once the low half comes."""
    code = match.group(3)
    return code is not None and 0xD800 <= int(code, 16) <= 0xDBFF


def decode_escapes(text: str) -> str:
    """`text` with every JSON escape resolved (escapes cut off at the end, and invalid ones, as written)."""
    return _ESCAPE.sub(_resolve, text) if "\\" in text else text


class Reading:
    r"""The decoded reading of one output, fed as it is generated, in windows for the output checks.

    Invariant: every run of up to `overlap + 1` decoded characters that holds a resolved escape lies whole in
    one window that `window()` or `final_windows()` returns (runs without one read as written: the raw
    reading's). `feed` keeps back only an escape that what follows could still change (`\u00` while `62` is
    to come; a high surrogate whose low half may follow): that text is read with what follows, or as written
    at the end.
    """

    def __init__(self, *, overlap: int, width: int) -> None:
        if not 0 <= overlap < width:
            raise ValueError(f"overlap must be in 0..{width - 1}, got {overlap}")
        self._overlap = overlap
        self._width = width
        self._pending = ""  # generated text whose reading may still change
        self._parts: list[str] = []  # decoded text from absolute position `_base` on, as read
        self._base = 0
        self._end = 0
        self._marks: list[int] = []  # absolute positions of the resolved escapes still held
        self._checked = 0  # decoded text before this was in a window already

    @property
    def end(self) -> int:
        """Decoded characters read so far."""
        return self._end

    def feed(self, text: str) -> None:
        """Read the next piece of generated text."""
        self._read(self._pending + text, final=False)

    def _read(self, pending: str, *, final: bool) -> None:
        """Decode `pending`; unless `final`, keep back an escape that what follows could still change."""
        self._pending = ""
        if "\\" not in pending:
            self._append(pending)
            return
        read = 0
        for match in _ESCAPE.finditer(pending):
            if not final and _high_surrogate(match) and match.start() > len(pending) - _PAIR:
                self._pending = pending[match.start() :]  # the low half may still come
                pending = pending[: match.start()]
                break
            self._append(pending[read : match.start()])
            self._marks.append(self.end)
            self._append(_resolve(match))
            read = match.end()
        cut = None if final or self._pending else _CUT_OFF.search(pending, read)
        if cut is not None:
            self._pending = pending[cut.start() :]
            pending = pending[: cut.start()]
        self._append(pending[read:])

    def window(self) -> str:
        """The decoded text read since the last window, after the `overlap` characters before it: "" when no
        escape was resolved in it."""
        start = max(self._checked - self._overlap, self._base)
        self._checked = self.end
        text = self._slice(start, self.end)
        self._forget(self.end - self._overlap)
        return text

    def final_windows(self) -> list[str]:
        """The output ended: what no window held yet (and the overlap before it), read with what was kept
        back as written, in windows of at most `width` characters overlapping by `overlap`; those in which
        an escape was resolved."""
        self._read(self._pending, final=True)
        start = max(self._checked - self._overlap, self._base)
        self._checked = end = self.end
        windows = []
        for offset in window_starts(end - start, self._width, self._overlap):
            if text := self._slice(start + offset, min(start + offset + self._width, end)):
                windows.append(text)
        return windows

    def _append(self, text: str) -> None:
        if text:
            self._parts.append(text)
            self._end += len(text)

    def _joined(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _slice(self, start: int, stop: int) -> str:
        """Decoded text [start, stop), or "" when no escape was resolved in it."""
        first = bisect.bisect_left(self._marks, start)
        if first == len(self._marks) or self._marks[first] >= stop:
            return ""
        return self._joined()[start - self._base : stop - self._base]

    def _forget(self, before: int) -> None:
        """Drop decoded text before `before`: no window reads it again."""
        if before <= self._base:
            return
        rest = self._joined()[before - self._base :]
        self._parts = [rest] if rest else []
        self._base = before
        del self._marks[: bisect.bisect_left(self._marks, before)]
