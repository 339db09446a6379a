r"""What a client reads in generated text once it decodes the JSON in it, for the output guard.

Tool-call arguments and structured output (`json_object`, `json_schema`, named and required tool calls) reach
the client as JSON, and the client reads them decoded: the model writes `{"x": "\u0062\u006f\u006d\u0062"}`,
the client's `json.loads` reads "bomb". The gateway itself re-serialises parsed calls (vLLM's Hermes parser,
`required` items) with the escapes resolved. Many apps also decode plain `content` that a prompt asked to be
JSON. So the output guard reads the output twice where decoding changes it: as generated, and decoded.

`readable(text)` is that decoded view: each line of `text` that holds a JSON escape (`\"`, `\\`, `\/`,
`\b`, `\f`, `\n`, `\r`, `\t`, `\uXXXX` with surrogate pairs), with its escapes resolved; "" when no line
reads differently. It needs no JSON parse and no string state, so it reads partial output mid-stream (and a
trailing window of it) the same way: outside JSON strings a backslash is not valid JSON, so resolving escapes
wherever they stand reads valid JSON exactly as a decoder does and only ever adds text to check elsewhere.
An escape cut off at the end (`\u00` while `62` is still to come) stays as written; the moderator's next
check sees it whole. Escapes never span a line (a JSON string holds no raw newline), hence lines: a long
answer with one escaped line adds that line, not a second copy of the answer.
"""

from __future__ import annotations

import re

__all__ = ["decode_escapes", "readable"]

# Left to right, a pair of backslashes is consumed as one escape, so `\\u0062` is a backslash and "u0062".
_ESCAPE = re.compile(
    r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})"  # a surrogate pair
    r"|\\u([0-9a-fA-F]{4})"
    r'|\\(["\\/bfnrt])'
)
_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
# Where no pair completes a surrogate (json.loads would keep it): a lone surrogate is not text a tokenizer
# takes, and a guard that cannot encode its input must not be the attacker's way to its fail mode.
_REPLACEMENT = "\ufffd"


def _resolve(match: re.Match[str]) -> str:
    high, low, code, simple = match.groups()
    if high is not None:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + (int(low, 16) - 0xDC00))
    if code is not None:
        point = int(code, 16)
        return _REPLACEMENT if 0xD800 <= point <= 0xDFFF else chr(point)
    return _SIMPLE[simple]


def decode_escapes(text: str) -> str:
    """`text` with every JSON escape resolved (escapes cut off at the end, and invalid ones, as written)."""
    return _ESCAPE.sub(_resolve, text) if "\\" in text else text


def readable(text: str) -> str:
    """The lines of `text` that read differently once JSON escapes are resolved, resolved (joined by
    newlines); "" when none does."""
    if "\\" not in text:
        return ""
    changed = []
    for line in text.split("\n"):
        decoded = decode_escapes(line)
        if decoded != line:
            changed.append(decoded)
    return "\n".join(changed)
