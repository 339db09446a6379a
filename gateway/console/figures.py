"""The console's table of publish figures: what the publish check measured for each policy and guard model
version (`gateway.publish_check`), and whether an operator forced it past a refusal.

Shown to reviewers of the operating organisation only: figures name every policy, and a tenant's reviewer
reads no other tenant's policy (as the registry's admin API).
"""

from __future__ import annotations

from html import escape

import msgspec

from guard.figures import Figures
from guard.redteam import TRANSFORMS
from registry.models import FiguresRecord

_FIGURES = msgspec.json.Decoder(Figures)
_COLUMNS = ("recall", "block_recall", "redteam_recall", "lookalike_fpr", "lookalike_block_rate")


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _row(record: FiguresRecord) -> str:
    figures = _FIGURES.decode(record.figures) if record.figures else None
    cells = [f"{record.name}@{record.version}", record.context or "", record.baseline or "none"]
    if figures is None:
        cells += ["-"] * (len(_COLUMNS) + 2)
    else:
        cells += [_rate(getattr(figures, c)) for c in _COLUMNS]
        cells.append(_rate(figures.escalation_rate))
        cells.append(" ".join(f"{t} {_rate(figures.by_transform.get(t))}" for t in TRANSFORMS))
    cells += ["forced" if record.forced else "", record.error, record.actor]
    return "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>"


def figures_body(records: list[FiguresRecord]) -> str:
    """A section with one row per recorded measurement, oldest first."""
    head = (
        "version", "measured in", "compared with", *_COLUMNS, "escalation_rate",
        "red-team recall by transform", "forced", "error", "by",
    )  # fmt: skip
    if not records:
        return "<section><h2>Publish figures</h2><p>No version was measured at publish yet.</p></section>"
    header = "".join(f"<th>{escape(h)}</th>" for h in head)
    rows = "".join(_row(r) for r in records)
    return (
        "<section><h2>Publish figures</h2><p>Measured by the publish check on the test split and the "
        f"red-team suite.</p><table><tr>{header}</tr>{rows}</table></section>"
    )
