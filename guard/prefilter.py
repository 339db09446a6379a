"""One scan that tells whether any of a set of patterns may match a text: the rules stage's prefilter.

A span the prefilter does not match matches none of its patterns, so the rules stage skips them all: one scan
of benign text (the common case) instead of one per rule. The patterns are joined into one alternation,
matched case-insensitively (regex rules are; a term rule's match is one too), which is a superset of what
they match one by one, as a prefilter may be.

Python's `re` matches a case-insensitive alternation about four times slower than the same alternation
matched as written (it loses its first-character fast paths), so where the text is ASCII (rules read
casefolded text: ASCII lowercase) and a pattern provably matches the same there either way (`case_free`),
that pattern is joined into a second alternation matched as written. A pattern that is not case-free (an
upper-case letter, a range that holds one, a scoped flag, a group reference) stays in the case-insensitive
one, which ASCII text is then scanned with too.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser  # type: ignore[attr-defined]
from typing import Any

__all__ = ["Prefilter", "case_free"]

# Ranges longer than this are not walked char by char: taken as not case-free.
_MAX_RANGE = 4_096


class Prefilter:
    """Whether any of `patterns` may match a text (never False where one of them matches it)."""

    def __init__(self, patterns: Sequence[str]) -> None:
        """re.error when the patterns cannot be joined (a global inline flag inside one, two groups of one
        name): the caller then runs them one by one."""
        self._any = _join(patterns, re.IGNORECASE)
        free = [p for p in patterns if case_free(p)]
        self._ascii = _join(free, 0)
        self._ascii_rest = _join([p for p in patterns if p not in free], re.IGNORECASE)

    def may_match(self, text: str) -> bool:
        """False only when no pattern matches `text`."""
        if not text.isascii() or text != text.lower():  # rules read casefolded text: the second is rare
            return self._any is not None and self._any.search(text) is not None
        return any(p is not None and p.search(text) is not None for p in (self._ascii, self._ascii_rest))


def _join(patterns: Sequence[str], flags: int) -> re.Pattern[str] | None:
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{p})" for p in patterns), flags)


def case_free(pattern: str) -> bool:
    """Whether `pattern` matches exactly the same in ASCII text without upper-case letters whether or not
    `re.IGNORECASE` is set.

    True when every character it names (literals, set members, every character of a range) is its own
    lower case and the lower case of its upper case (`_plain`): then, on such text, `re`'s case-insensitive
    comparisons (the text's character lowered, or for a range also its upper case, against the pattern's
    characters lowered, plus `re`'s extra equivalences such as i and dotless i, s and long s, all of them
    non-ASCII) accept exactly the characters that equal the pattern's. Scoped flags, group references and
    conditionals make it False (not analysed), as does a pattern that does not parse.
    """
    try:
        parsed = _parser.parse(pattern, 0)
    except re.error:
        return False
    return parsed.state.flags == re.UNICODE and _items_free(parsed)


def _items_free(items: Any) -> bool:
    return all(_item_free(op, av) for op, av in items)


def _item_free(op: Any, av: Any) -> bool:
    if op in (sre.LITERAL, sre.NOT_LITERAL):
        return _plain(chr(av))
    if op is sre.RANGE:
        lo, hi = av
        return hi - lo <= _MAX_RANGE and all(_plain(chr(c)) for c in range(lo, hi + 1))
    if op is sre.IN:
        return all(_item_free(o, a) for o, a in av)
    if op in (sre.ANY, sre.AT, sre.CATEGORY, sre.NEGATE):
        return True
    if op is sre.BRANCH:
        return all(_items_free(branch) for branch in av[1])
    if op is sre.SUBPATTERN:
        _group, add_flags, del_flags, body = av
        return not add_flags and not del_flags and _items_free(body)
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
        return _items_free(av[2])
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return _items_free(av[1])
    if op is sre.ATOMIC_GROUP:
        return _items_free(av)
    return False  # GROUPREF, GROUPREF_EXISTS, and anything newer


def _plain(c: str) -> bool:
    """Lower case, and the lower case of its own upper case: 'a', 'ö', '1', ' ' (not 'A', 'ß', dotless i or
    long s)."""
    return c.lower() == c and c.upper().lower() == c
