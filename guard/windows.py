"""Overlapping windows over a sequence too long to judge at once.

The guards score a long text window by window (`guard.one_token`, `guard.embedding`), and the output
moderator scores a long answer window by window (`guard.moderator`): all of them lay the windows out here.
"""

from __future__ import annotations


def window_starts(length: int, width: int, overlap: int) -> list[int]:
    """Starts of the windows of `width` items that cover `length` items, consecutive ones overlapping by
    `overlap` (one window, at 0, when `length <= width`).

    Invariant: the windows together cover every item, and any run of at most `overlap + 1` items lies whole
    in one window (a run that a window boundary cuts began in the previous window's last `overlap` items).
    """
    if not 0 <= overlap < width:
        # A step of 0 or less would never get past the first window.
        raise ValueError(f"overlap must be in 0..{width - 1}, got {overlap}")
    starts = [0]
    while starts[-1] + width < length:
        starts.append(starts[-1] + width - overlap)
    return starts
