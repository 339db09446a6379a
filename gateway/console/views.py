"""The reviewer console's HTML: server-rendered pages, every value passed through `html.escape`.

No script and no external asset: the only styles are the inline sheet below, and the page's
Content-Security-Policy (set by `gateway.console.pages`) forbids fetching anything else.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from urllib.parse import quote

from policy.appeals.base import Appeal, AppealClaim, AppealEvent, AppealEvidence
from policy.appeals.reasons import ReasonCode
from policy.audit.records import AuditedStage, AuditRecord

_STYLE = """
body{font-family:system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:.6rem 1.2rem;display:flex;gap:1.2rem;align-items:center}
header a{color:#cfe1ff}header form{margin-left:auto}main{padding:1rem 1.2rem;max-width:72rem}
table{border-collapse:collapse;background:#fff;margin:.5rem 0 1.2rem}
td,th{border:1px solid #d5d9e0;padding:.3rem .6rem;text-align:left;vertical-align:top}
pre{white-space:pre-wrap;background:#fff;border:1px solid #d5d9e0;padding:.6rem}
.error{color:#a01616}.notice{background:#e5f4e8;border:1px solid #8bc79a;padding:.6rem}
.over{color:#a01616;font-weight:600}.under{color:#1b6e2c}
textarea{width:30rem;height:4rem}button{margin-right:.6rem}
"""


def _t(value: object) -> str:
    """Any value as escaped text (None as an em dash)."""
    return "—" if value is None else escape(str(value), quote=True)


def _q(value: str) -> str:
    """A value for a URL query, percent-encoded and then escaped for an attribute."""
    return _t(quote(value, safe=""))


def when(at: float) -> str:
    """A unix time as UTC text."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def page(title: str, body: str, *, csrf: str | None = None, who: str = "") -> str:
    """A whole page; signed in (`csrf` given), with the navigation and a sign-out button."""
    nav = ""
    if csrf is not None:
        nav = (
            '<a href="/console">Queue</a><a href="/console/policies">Policies</a>'
            f"<span>{_t(who)}</span>"
            f'<form method="post" action="/console/logout">{csrf_field(csrf)}'
            '<button type="submit">Sign out</button></form>'
        )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{_t(title)} · Lockgate review</title><style>{_STYLE}</style></head>"
        f"<body><header><strong>Lockgate review</strong>{nav}</header><main><h1>{_t(title)}</h1>"
        f"{body}</main></body></html>"
    )


def csrf_field(token: str) -> str:
    """The hidden form field that carries the session's CSRF token."""
    return f'<input type="hidden" name="csrf" value="{_t(token)}">'


def login_page(csrf: str, message: str = "") -> str:
    """The sign-in form with its CSRF token (and an error `message`, after a refused attempt)."""
    error = f'<p class="error" role="alert">{_t(message)}</p>' if message else ""
    form = (
        f'{error}<form method="post" action="/console/login">{csrf_field(csrf)}'
        '<label>API key of a reviewer <input type="password" name="key" autocomplete="off" required>'
        '</label> <button type="submit">Sign in</button></form>'
    )
    return page("Sign in", form)


def error_page(message: str, *, csrf: str | None = None, who: str = "") -> str:
    """An error, in words."""
    return page("Error", f'<p class="error" role="alert">{_t(message)}</p>', csrf=csrf, who=who)


def _link(tenant: str, seq: int) -> str:
    return f'<a href="/console/decisions/{_t(tenant)}/{seq}">{_t(tenant)} #{seq}</a>'


def queue_page(
    appeals: Iterable[Appeal],
    flagged: Iterable[AuditRecord],
    *,
    truncated: bool,
    next_after: str | None,
    claims: Mapping[str, AppealClaim] | None = None,
    filters: Mapping[str, str] | None = None,
    counts: Mapping[str, Mapping[str, int]] | None = None,
    csrf: str,
    who: str,
) -> str:
    """The filter form (each facet's values with how many undecided appeals each leaves), a page of open
    and in-review appeals (oldest filed first unless sorted newest first, with who has claimed each; a link
    to the next page after the appeal `next_after`, filters kept), then flagged decisions nobody has
    reviewed, newest first."""
    claims, filters, counts = claims or {}, filters or {}, counts or {}
    appeal_rows = "".join(
        f"<tr><td>{_link(a.tenant, a.decision_seq)}</td><td>{_t(a.state)}</td><td>{_t(when(a.filed_at))}"
        f"</td><td>{_t(a.filed_by)}</td><td>{_t(a.reason)}</td><td>{_claimed(claims.get(a.appeal_id))}</td></tr>"
        for a in appeals
    )
    flagged_rows = "".join(
        f"<tr><td>{_link(r.tenant, r.seq)}</td><td>{_t(r.decision)}</td><td>{_t(r.source)}</td>"
        f"<td>{_t(r.policy)}</td><td>{_t(r.category)}</td><td>{_t(when(r.at))}</td></tr>"
        for r in flagged
    )
    note = "<p>Only the most recent flagged decisions were read.</p>" if truncated else ""
    more = ""
    if next_after is not None:
        kept = "".join(f"&{_q(name)}={_q(value)}" for name, value in filters.items())
        more = f'<p><a id="next" href="/console?after={_q(next_after)}{kept}">Next</a></p>'
    total = sum(counts.get("tenant", {}).values())
    body = _filter_form(filters, counts) + f'<p id="matching">{total} undecided appeals match.</p>'
    body += (
        '<h2>Appeals</h2><table id="appeals"><tr><th>Decision</th><th>State</th><th>Filed</th><th>By</th>'
        "<th>Reason</th><th>Claimed</th></tr>"
        f"{appeal_rows or '<tr><td colspan=6>None open</td></tr>'}</table>{more}"
        '<h2>Flagged decisions</h2><table id="flagged"><tr><th>Decision</th><th>Outcome</th><th>Source</th>'
        "<th>Policy</th><th>Category</th><th>At</th></tr>"
        f"{flagged_rows or '<tr><td colspan=6>None to review</td></tr>'}</table>{note}"
    )
    return page("Review queue", body, csrf=csrf, who=who)


# The queue's filter form: (parameter, label) of each facet select.
_FILTERS = (
    ("tenant", "Tenant"),
    ("category", "Category"),
    ("severity", "Severity"),
    ("decision", "Outcome"),
    ("stage", "Stage"),
    ("source", "Source"),
    ("policy", "Policy version"),
)


def _filter_form(filters: Mapping[str, str], counts: Mapping[str, Mapping[str, int]]) -> str:
    """A GET form over the queue: a select per facet listing its values with their counts (the chosen
    value kept even when nothing matches it), age bounds and the sort."""
    fields = ""
    for name, label in _FILTERS:
        chosen = filters.get(name, "")
        values = dict(counts.get(name, {}))
        if chosen:
            values.setdefault(chosen, 0)
        options = '<option value="">any</option>' + "".join(
            f'<option value="{_t(v)}"{" selected" if v == chosen else ""}>{_t(v or "(none)")} ({n})</option>'
            for v, n in sorted(values.items(), key=lambda item: (-item[1], item[0]))
        )
        fields += f'<label>{label} <select name="{name}">{options}</select></label> '
    for name, label in (("older_than", "Older than (s)"), ("newer_than", "Newer than (s)")):
        fields += (
            f'<label>{label} <input name="{name}" inputmode="numeric" size="8" '
            f'value="{_t(filters.get(name, ""))}"></label> '
        )
    newest = filters.get("sort") == "newest"
    sort = (
        f'<label>Sort <select name="sort"><option value="oldest">oldest first</option><option value="newest"'
        f"{' selected' if newest else ''}>newest first</option></select></label>"
    )
    button = '<button type="submit">Filter</button>'
    return f'<form id="filters" method="get" action="/console">{fields}{sort} {button}</form>'


def _claimed(claim: AppealClaim | None) -> str:
    """Who has claimed an appeal, until when ("" when nobody has)."""
    return "" if claim is None else f"{_t(claim.reviewer)} until {_t(when(claim.expires_at))}"


def _stage_row(run: AuditedStage) -> str:
    verdict = ""
    if run.score is not None:
        if run.block_above is not None and run.score > run.block_above:
            verdict = '<span class="over">above block threshold</span>'
        elif run.allow_below is not None and run.score < run.allow_below:
            verdict = '<span class="under">below allow threshold</span>'
        elif run.allow_below is not None or run.block_above is not None:
            verdict = "in the review band"
    return (
        f"<tr><td>{_t(run.stage)}</td><td>{_t(run.kind)}</td><td>{_t(run.model)}</td>"
        f"<td>{_t(run.score)}</td><td>{_t(run.allow_below)}</td><td>{_t(run.block_above)}</td>"
        f"<td>{verdict}</td><td>{run.latency_s:.4f}</td><td>{_t(run.error)}</td>"
        f"<td>{_t(run.template_hash)}</td></tr>"
    )


_FIELDS = (
    "tenant", "seq", "request_id", "key_id", "stage", "decision", "source", "policy", "policy_hash",
    "category", "severity", "flagged", "detail", "reverses", "actor", "content_hash", "prev_hash", "hash",
)  # fmt: skip


# The decide form's buttons: (outcome field value, appeal state, label).
_DECISIONS = (("uphold", "upheld", "Uphold"), ("overturn", "overturned", "Overturn"))


def decision_page(
    record: AuditRecord,
    appeal: Appeal | None,
    events: Iterable[AppealEvent],
    *,
    evidence: AppealEvidence | None = None,
    claim: AppealClaim | None = None,
    decidable: bool,
    reasons: Sequence[ReasonCode] = (),
    outcome: str = "",
    csrf: str,
    who: str,
) -> str:
    """Every field of one recorded decision, its stages against their thresholds, its content if retained
    (or else as the consumer shared it with the appeal), its appeal and events, and the uphold / overturn
    form while it can still be decided."""
    fields = "".join(f"<tr><th>{name}</th><td>{_t(getattr(record, name))}</td></tr>" for name in _FIELDS)
    fields += f"<tr><th>at</th><td>{_t(when(record.at))} ({record.at})</td></tr>"
    if record.count != 1 or record.last_at is not None:  # refusals counted over an interval
        last = record.last_at if record.last_at is not None else record.at
        fields += f"<tr><th>count</th><td>{record.count}</td></tr>"
        fields += f"<tr><th>last_at</th><td>{_t(when(last))} ({last})</td></tr>"
    stages = "".join(_stage_row(run) for run in record.stages) or "<tr><td colspan=10>None</td></tr>"
    if record.content is not None:
        content = f'<pre id="content">{_t(record.content)}</pre>'
    elif evidence is not None:
        how = "copied from the retained record" if evidence.source == "retained" else "attached"
        content = (
            f'<p id="content-shared">Not retained; shared by the consumer with the appeal ({how}, its sha256 '
            f"matching content_hash), kept until {_t(when(evidence.expires_at))}.</p>"
            f'<pre id="content">{_t(evidence.content)}</pre>'
        )
        if evidence.request_content is not None:
            content += (
                "<p>The request this answer was given to, shared with it:</p>"
                f'<pre id="request-content">{_t(evidence.request_content)}</pre>'
            )
    else:
        content = "<p>Not retained.</p>"
    body = f'<p class="notice" id="outcome" role="status">{_t(outcome)}</p>' if outcome else ""
    body += (
        f'<table id="fields">{fields}</table><h2>Stages</h2><table id="stages"><tr><th>Stage</th>'
        "<th>Kind</th><th>Model</th><th>Score</th><th>Allow below</th><th>Block above</th><th>Verdict</th>"
        f"<th>Latency (s)</th><th>Error</th><th>Template</th></tr>{stages}</table>"
        f"<h2>Content</h2>{content}<h2>Appeal</h2>"
    )
    if appeal is None:
        body += "<p>No appeal.</p>"
    else:
        rows = "".join(
            f"<tr><td>{e.n}</td><td>{_t(when(e.at))}</td><td>{_t(e.actor)}</td><td>{_t(e.from_state)}</td>"
            f"<td>{_t(e.to_state)}</td><td>{_t(e.reason.code if e.reason else '')}</td><td>{_t(e.facts)}</td>"
            f"<td>{_t(e.note)}</td></tr>"
            for e in events
        )
        body += (
            f'<p id="appeal-state">{_t(appeal.appeal_id)}: <strong>{_t(appeal.state)}</strong> '
            f'(reason: {_t(appeal.reason)})</p><table id="events"><tr><th>n</th><th>At</th><th>Actor</th>'
            f"<th>From</th><th>To</th><th>Reason</th><th>Facts</th><th>Note</th></tr>{rows}</table>"
        )
    if decidable:
        claim_action = f"/console/decisions/{_t(record.tenant)}/{record.seq}/claim"
        held = f"Claimed by {_claimed(claim)}." if claim is not None else "Nobody has claimed it."
        body += (
            f'<h2>Claim</h2><p id="claim">{held}</p><form method="post" action="{claim_action}">'
            f'{csrf_field(csrf)}<button type="submit" id="claim-button">Claim for review</button></form>'
        )
        action = f"/console/decisions/{_t(record.tenant)}/{record.seq}/decide"
        choices = ""
        for button, outcome, label in _DECISIONS:
            options = "".join(
                f'<option value="{_t(r.code)}">{_t(r.code)}: {_t(r.text)}</option>'
                for r in reasons
                if r.outcome == outcome
            )
            choices += (
                f'<p><label>Reason to {button} <select name="reason_{button}">{options}</select></label>'
                f'<button type="submit" name="outcome" value="{button}">{label}</button></p>'
            )
        body += (
            f'<h2>Decide</h2><form method="post" action="{action}">{csrf_field(csrf)}'
            '<p><label>Facts relied on (the consumer reads them) <textarea name="facts" maxlength="4000">'
            "</textarea></label></p>"
            '<p><label>Note (internal) <textarea name="note" maxlength="4000"></textarea></label></p>'
            f"{choices}</form>"
        )
    return page(f"Decision {record.tenant} #{record.seq}", body, csrf=csrf, who=who)
