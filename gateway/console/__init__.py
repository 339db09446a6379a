"""The reviewer console: server-rendered pages over the audit trail and appeals (`pages`, its routes), their
request plumbing (`plumbing`: session cookie, signed-in reviewer, error pages), sign-in (`login`), HTML
(`views`), policy statistics (`stats`), publish figures (`figures`), the review queue it shares with the
reviewer API (`review_queue`), and the session stores (`sessions/`).

Nothing is re-exported here: `gateway.api.appeals` imports `review_queue` without pulling in the pages.
"""
