"""Audit records and their hash chain: what one gate decision leaves behind, and how tampering shows.

Each tenant has its own chain: record `seq` n (1, 2, 3, ... with no gaps) carries the hash of record n - 1
(`prev_hash`, `GENESIS_HASH` for seq 1) and its own `hash`::

    hash = sha256(DOMAIN + canonical JSON of every field but `hash` and `content`)

The canonical JSON has sorted keys, floats as floats (an int `at` hashes as the float the database returns),
and includes `seq`, `prev_hash` and `content_hash` (and `draft_id` when it is set, `count` when it is not 1
and `last_at` when it is set: records written before they existed hash as they did). `content_hash` stands
for the content, so purging the content (retention) leaves every hash valid, while changing any other field,
deleting a record or reordering records breaks the chain, and `verify_chain` names the first record where it
breaks.

A database writer could still rewrite records and recompute every hash, so each record also carries
`mac`, an HMAC of its hash under a key that is never in the database (`policy.audit.keys`): records without
one (written before keys existed) verify as "unkeyed", but only before the chain's first keyed record.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

if TYPE_CHECKING:
    from policy.audit.keys import MacKey

Stage = Literal["quota", "input", "output", "admission", "review"]
Decision = Literal["allow", "block", "refuse", "deny", "flag", "reversal", "uphold"]
# Why a chain does not verify (`ChainReport.reason`).
ChainFault = Literal[
    "seq_gap",  # a record is missing (or the chain does not start at 1): first_bad_seq is the missing seq
    "prev_hash",  # prev_hash is not the previous record's hash
    "hash",  # the record's fields do not hash to its `hash`: it was changed
    "content",  # content is present, but its sha256 is not content_hash
    "tenant",  # a record of another tenant is in the chain
    "head",  # the store's head (last seq and hash) is not the last record: records were cut off the end
    "mac",  # the record's MAC is not its hash's under the key (or it has none after keyed records)
    "checkpoint",  # the chain differs from a signed checkpoint, or ends before the latest one
]

# prev_hash of each tenant's first record.
GENESIS_HASH = ""
# Prefixed to what is hashed, so a record hash can never be mistaken for a hash of anything else.
_DOMAIN = b"lockgate-audit-v1\n"


class AuditedStage(msgspec.Struct, frozen=True, kw_only=True):
    """One guard stage as it ran for a decision, as the audit record keeps it (`guard.cascade.StageRun` is
    the cascade's own, fuller account of the run)."""

    stage: str  # "rules" or the guard version name@version
    kind: Literal["rules", "model", "combine"]
    model: str | None = None  # model@version the guard ran on
    template_hash: str | None = None
    score: float | None = None
    allow_below: float | None = None
    block_above: float | None = None
    latency_s: float = 0.0
    error: str | None = None


class AuditDraft(msgspec.Struct, frozen=True, kw_only=True):
    """A decision to record: everything but its place in the tenant's chain (`AuditStore.append` adds it)."""

    tenant: str
    key_id: str
    request_id: str
    at: float
    stage: Stage
    decision: Decision
    source: str  # none|rules|model|band|fail_open|fail_closed|quota|deadline|reviewer|...
    policy: str = ""  # policy name@version
    policy_hash: str = ""
    stages: tuple[AuditedStage, ...] = ()
    category: str | None = None
    severity: str | None = None
    flagged: bool = False  # escalated for human review
    content_hash: str = ""  # sha256 of the checked content (always)
    content: str | None = None  # the content itself, only when the tenant's retention allows
    detail: str = ""
    reverses: int | None = None  # seq of the record a reversal (or uphold) refers to
    actor: str = ""  # reviewer key id for review records
    # The writer's id for this draft (`AuditWriter` gives each one it accepts): a draft appended again (a
    # spool batch replayed after a crash, an append whose reply was lost) is found by it and not recorded
    # twice. "" (records from before it existed, drafts appended straight to a store): no such check.
    draft_id: str = ""
    # How many decisions this record stands for: 1, or for the repeated no-cost refusals of one key for one
    # reason in one interval, their number (`policy.audit.refusals`), `at` the first of them and `last_at`
    # the last.
    count: Annotated[int, msgspec.Meta(ge=1)] = 1
    last_at: float | None = None


class AuditRecord(AuditDraft, frozen=True, kw_only=True):
    """A stored decision: a draft with its place in the tenant's hash chain."""

    seq: int  # per tenant, 1, 2, 3, ... (no gaps)
    prev_hash: str  # hash of the tenant's previous record (GENESIS_HASH for seq 1)
    hash: str
    # HMAC of `hash` under the audit MAC key (None: written without a key, before keys existed).
    mac: str | None = None


class ChainReport(msgspec.Struct, frozen=True, kw_only=True):
    """The result of verifying one tenant's chain: `ok`, or the first bad seq and why."""

    ok: bool
    checked: int  # records read up to and including the first bad one
    first_bad_seq: int | None = None
    reason: ChainFault | None = None
    detail: str = ""
    last_seq: int = 0  # the last good record's seq (0: none)
    last_hash: str = GENESIS_HASH
    unkeyed: int = 0  # records checked that carry no MAC (from before the chain was keyed)


_OMITTED_AT_DEFAULT: tuple[tuple[str, Any], ...] = (("draft_id", ""), ("count", 1), ("last_at", None))
_encode_sorted = msgspec.json.Encoder(order="sorted")
_encode = msgspec.json.Encoder()


class InvalidDraftError(ValueError):
    """A draft that cannot be recorded: a field of the wrong type, a non-finite number, or content whose
    sha256 is not its content_hash."""


def content_sha256(text: str) -> str:
    """sha256 (hex) of content, as `content_hash` holds it (a lone surrogate hashed as its UTF-8 form would
    be: it has one, and it must not make the hash fail)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# What PostgreSQL's text cannot hold (NUL) and what UTF-8 cannot encode (lone surrogates).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def unstorable(text: str) -> bool:
    """Whether `text` holds a character some store cannot hold as text."""
    if text.isascii():  # the common case, without a regex call: only NUL can be unstorable there
        return "\x00" in text
    return _UNSTORABLE.search(text) is not None


def _storable(value: Any) -> Any:
    """`value` (builtins) with every unstorable character of its strings replaced by U+FFFD."""
    if isinstance(value, str):
        return _UNSTORABLE.sub("\ufffd", value) if unstorable(value) else value
    if isinstance(value, (list, tuple)):  # to_builtins keeps a tuple field (`stages`) a tuple
        return [_storable(v) for v in value]
    if isinstance(value, dict):
        return {k: _storable(v) for k, v in value.items()}
    return value


def normalize(draft: AuditDraft) -> AuditDraft:
    """`draft` (or the draft part of a record) checked and in canonical types (floats as floats).

    Fills in `content_hash` from `content` when it is empty. InvalidDraftError when a field has the wrong
    type, a number is not finite, or content does not match a given content_hash.
    """
    try:
        builtins: dict[str, Any] = msgspec.to_builtins(draft)
        # Every text but the content in a form every store holds (content is stored exactly: see
        # `policy.audit.migrations.stored_content`).
        content = builtins.pop("content", None)
        if not _plainly_storable(builtins):
            builtins = _storable(builtins)
        builtins["content"] = content
        clean = msgspec.convert(builtins, AuditDraft)  # a record's own fields (seq, hash...) are dropped
    except (msgspec.ValidationError, TypeError) as exc:
        raise InvalidDraftError(f"invalid audit draft: {exc}") from exc
    numbers = [
        clean.at,
        *([] if clean.last_at is None else [clean.last_at]),
        *(n for run in clean.stages for n in _stage_numbers(run)),
    ]
    if not all(math.isfinite(n) for n in numbers):
        raise InvalidDraftError("audit draft numbers must be finite")
    if clean.content is not None:
        digest = content_sha256(clean.content)
        if not clean.content_hash:
            clean = msgspec.structs.replace(clean, content_hash=digest)
        elif clean.content_hash != digest:
            raise InvalidDraftError("content_hash is not the sha256 of content")
    return clean


def _plainly_storable(builtins: dict[str, Any]) -> bool:
    """Whether every text in `builtins` is ASCII without NUL (the common case, in one C call: such text
    needs no `_storable` walk). False also for text that merely looks escaped ("\\u0000")."""
    try:
        encoded = _encode.encode(builtins)
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return encoded.isascii() and b"\\u0000" not in encoded


def _stage_numbers(run: AuditedStage) -> list[float]:
    values = (run.score, run.allow_below, run.block_above, run.latency_s)
    return [v for v in values if v is not None]


def canonical_json(draft: AuditDraft, seq: int, prev_hash: str, *, normalized: bool = False) -> bytes:
    """The bytes hashed for a record: every field but `hash` and `content`, keys sorted. `normalized`: the
    draft is one `normalize` returned (its types are canonical already)."""
    if not normalized:
        # Through `convert`, so an int where a float belongs hashes as that float (what the database
        # returns); a record's own fields (seq, hash...) are dropped by it.
        draft = msgspec.convert(msgspec.to_builtins(draft), AuditDraft)
    payload: dict[str, Any] = msgspec.to_builtins(draft)
    del payload["content"]
    # Fields added later are left out at their defaults, so records written before them hash as they did.
    for name, default in _OMITTED_AT_DEFAULT:
        if payload[name] == default:
            del payload[name]
    payload["seq"] = int(seq)
    payload["prev_hash"] = prev_hash
    return _encode_sorted.encode(payload)


def record_hash(draft: AuditDraft, seq: int, prev_hash: str, *, normalized: bool = False) -> str:
    """The hash of `draft` (or a record's draft part) at `seq` after a record hashed `prev_hash`."""
    return hashlib.sha256(_DOMAIN + canonical_json(draft, seq, prev_hash, normalized=normalized)).hexdigest()


def chain(
    draft: AuditDraft, seq: int, prev_hash: str, key: MacKey | None = None, *, normalized: bool = False
) -> AuditRecord:
    """`draft` as the record at `seq` after `prev_hash`, MACed with `key` if given. `normalized`: `draft` is
    one `normalize` returned (the stores check each draft before they take the write lock), else it is
    normalized here."""
    clean = draft if normalized else normalize(draft)
    digest = record_hash(clean, seq, prev_hash, normalized=True)
    mac = None if key is None else key.chain_mac(digest)
    return AuditRecord(**msgspec.structs.asdict(clean), seq=seq, prev_hash=prev_hash, hash=digest, mac=mac)


class ChainVerifier:
    """Checks one tenant's records fed in seq order, one at a time (so a long chain is never all in memory).

    Invariant: while `ok`, the records fed so far are seq 1..last_seq, each chained to the one before.
    """

    def __init__(
        self,
        tenant: str | None = None,
        key: MacKey | None = None,
        *,
        after: tuple[int, str] = (0, GENESIS_HASH),
        keyed: bool = False,
        pins: Mapping[int, str] | None = None,
    ) -> None:
        """Check records of `tenant` (None: of the tenant of the first record), and their MACs with `key`
        (None: MACs are not checked). The first record fed is the one `after` (seq, hash) the last one
        verified (seq 1 by default); `keyed`: a record with a MAC came before it. `pins`: hashes that
        signed checkpoints say records (by seq) have."""
        self._tenant = tenant
        self._key = key
        self._checked = 0
        self._last_seq, self._last_hash = after
        self._keyed = keyed
        self._unkeyed = 0
        self._pins = pins or {}
        self._fault: tuple[int, ChainFault, str] | None = None

    @property
    def ok(self) -> bool:
        """No fault found so far."""
        return self._fault is None

    def feed(self, record: AuditRecord) -> bool:
        """Check the next record; False (and no further checks) once a fault is found."""
        if self._fault is not None:
            return False
        self._checked += 1
        fault = self._check(record)
        if fault is not None:
            self._fault = fault
            return False
        self._last_seq, self._last_hash = record.seq, record.hash
        return True

    def _check(self, record: AuditRecord) -> tuple[int, ChainFault, str] | None:
        if self._tenant is None:
            self._tenant = record.tenant
        if record.tenant != self._tenant:
            return record.seq, "tenant", f"record of tenant {record.tenant!r} in {self._tenant!r}'s chain"
        expected = self._last_seq + 1
        if record.seq != expected:
            return expected, "seq_gap", f"expected seq {expected}, found {record.seq}"
        if record.prev_hash != self._last_hash:
            return record.seq, "prev_hash", "prev_hash is not the previous record's hash"
        try:
            actual = record_hash(record, record.seq, record.prev_hash)
        except (msgspec.ValidationError, TypeError) as exc:
            return record.seq, "hash", f"record does not hash: {exc}"
        if actual != record.hash:
            return record.seq, "hash", "the record's fields do not match its hash"
        if record.content is not None and content_sha256(record.content) != record.content_hash:
            return record.seq, "content", "content is not what content_hash was computed from"
        if record.mac is None:
            if self._keyed:
                return record.seq, "mac", "a record without a MAC after keyed records"
            self._unkeyed += 1
        else:
            self._keyed = True
            if self._key is not None and not self._key.chain_ok(record.hash, record.mac):
                return record.seq, "mac", "the record's MAC is not its hash's under the audit key"
        if self._pins.get(record.seq, record.hash) != record.hash:
            return record.seq, "checkpoint", "the record is not the one a signed checkpoint names"
        return None

    def fail(self, seq: int, reason: ChainFault, detail: str, *, read: bool = True) -> None:
        """Record a fault found outside `feed` (a stored row that does not even decode: `read`; or what
        the chain lacks), unless one was."""
        if self._fault is None:
            self._checked += int(read)
            self._fault = (seq, reason, detail)

    def check_head(self, seq: int, head_hash: str) -> None:
        """Check, after the last record, that the store's head (last seq and hash it recorded) matches it."""
        if self._fault is None and (seq, head_hash) != (self._last_seq, self._last_hash):
            missing = self._last_seq + 1
            self._fault = (
                missing,
                "head",
                f"the head is seq {seq}, the last record seq {self._last_seq}",
            )

    def report(self) -> ChainReport:
        """What was found so far."""
        if self._fault is None:
            return ChainReport(
                ok=True,
                checked=self._checked,
                last_seq=self._last_seq,
                last_hash=self._last_hash,
                unkeyed=self._unkeyed,
            )
        seq, reason, detail = self._fault
        return ChainReport(
            ok=False,
            checked=self._checked,
            first_bad_seq=seq,
            reason=reason,
            detail=detail,
            last_seq=self._last_seq,
            last_hash=self._last_hash,
            unkeyed=self._unkeyed,
        )


def verify_chain(
    records: Iterable[AuditRecord], *, tenant: str | None = None, key: MacKey | None = None
) -> ChainReport:
    """Verify one tenant's whole chain, given in seq order from seq 1 (an empty chain is ok)."""
    verifier = ChainVerifier(tenant, key)
    for record in records:
        if not verifier.feed(record):
            break
    return verifier.report()


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A tenant's chain head at one time: the record at `seq` has `hash` (and `mac`)."""

    tenant: str
    seq: int
    hash: str
    mac: str | None
    at: float
