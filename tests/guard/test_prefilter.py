"""The rules stage's prefilter: never says no where a pattern (matched case-insensitively) matches."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.prefilter import Prefilter, case_free

# Atoms chosen to reach every corner of case-insensitive matching: upper-case letters, a range that holds
# upper-case letters although its ends are not letters ([@-_]), negations, and the characters `re` folds
# onto ASCII ones (dotless i, long s, the Kelvin sign) or that fold to two letters (sharp s).
_ATOMS = [
    *("a", "b", "i", "k", "s", "A", "I", "K", "S"),
    *("[a-c]", "[@-_]", "[^a]", "[^A]", "[ks]", ".", r"\w", r"\b", " "),
    *(
        "ß",
        "\u0131",
        "\u017f",
        "\u212a",
        "é",
        "É",
        "(?:x|y)",
        "(?!b)",
        "(?<=a)",
        "a+",
        "(a)",
        "\\x41",
        "\\N{LATIN SMALL LETTER A}",
    ),
]
# Mostly casefolded ASCII (the fast path), sometimes anything.
_ASCII = ["a", "b", "i", "k", "s", "x", "y", "@", "_", " "]
_ANY = [*_ASCII, "A", "I", "K", "S", "ß", "\u0131", "\u017f", "\u212a", "é", "É"]
_TEXT = st.one_of(*(st.lists(st.sampled_from(chars), max_size=8).map("".join) for chars in (_ASCII, _ANY)))


@pytest.mark.parametrize(
    ("pattern", "free"),
    [
        ("a", True),
        (r"\bhow to (?:make|build) a? ?bomb\b", True),
        ("[a-z]+", True),
        ("wie töte ich mich", True),
        (r"(?<!\w)x(?!\w)", True),
        ("A", False),
        ("[@-_]", False),  # holds A-Z between two ends that are not letters
        ("ß", False),  # upper case SS, lower case ss
        ("\u0131", False),  # dotless i: re folds i onto it
        ("\u017f", False),  # long s: re folds s onto it
        ("\\x41", False),  # an escaped A
        ("(?-i:x)", False),  # a scoped flag
        (r"(a)(?(1)b|c)", False),  # a conditional
        (r"(a)\1", False),  # a group reference
        ("(", False),  # does not parse
    ],
)
def test_what_is_case_free(pattern: str, free: bool) -> None:
    assert case_free(pattern) is free


@settings(max_examples=400, deadline=None)
@given(
    patterns=st.lists(st.lists(st.sampled_from(_ATOMS), min_size=1, max_size=4).map("".join), min_size=1),
    texts=st.lists(_TEXT, min_size=1, max_size=5),
)
def test_the_prefilter_answers_as_every_pattern_matched_case_insensitively(
    patterns: list[str], texts: list[str]
) -> None:
    try:
        prefilter = Prefilter(patterns)
    except re.error:  # two groups of one name cannot happen here; a pattern the atoms make invalid can
        return
    for text in texts:
        expected = any(re.search(p, text, re.IGNORECASE) for p in patterns)
        assert prefilter.may_match(text) is expected, (patterns, text)


def test_ascii_text_skips_the_case_insensitive_scan_for_case_free_patterns() -> None:
    # What makes it fast: with every pattern case-free, ASCII text meets no case-insensitive pattern at all.
    prefilter = Prefilter([r"\bpipe bomb\b", "ransomware"])
    assert prefilter._ascii is not None
    assert prefilter._ascii.flags & re.IGNORECASE == 0
    assert prefilter._ascii_rest is None
    assert prefilter.may_match("how to build a pipe bomb")
    assert prefilter.may_match("HOW TO BUILD A PIPE BOMB")  # not casefolded: the case-insensitive scan
    assert prefilter.may_match("how to build a p\u0131pe bomb")  # dotless i: the case-insensitive scan
    assert not prefilter.may_match("how to bake bread")
    # Ends that are not letters, and A-Z between them: matched case-insensitively, it matches "a".
    assert Prefilter(["[@-_]"]).may_match("a")
