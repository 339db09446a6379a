"""`RequestTimeline`: one request's record of where its time went, from arrival to the end of its response.

The observe middleware creates it when the request arrives (the injected clock's time) and keeps it in the
ASGI scope; the request path fills it in as it goes::

    arrival ─ auth ─ render ─ quota ─ input_guard ─ queue ─┬─ first token ─ ... tokens ... ─ last token ─ end
                                                           └─ output guard checks (while decoding)

Each phase is a (start, end) pair on the same clock; engine time to first token and decode are derived from
the token timestamps (one float appended per engine delta that brought tokens, nothing else per token). The
request ends when both its HTTP response has ended and, for a generation request that got as far as an
engine, its tracker has reported the `Outcome` (a cancelled stream may report after the response ended);
then the timeline is handed to the observer once: metrics, the request log line, and later trace spans.

Invariant: `arrival <= every phase start <= its end <= end`, when the clock does not go backwards.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from gateway.observe.trace import new_span_id, new_trace_id
from guard.cascade import StageRun
from policy.clock import Clock

if TYPE_CHECKING:
    from gateway.observe.outcome import Outcome
    from policy.safety.decision import GuardDecision

Phase = Literal["auth", "render", "quota", "input_guard", "queue"]
# Where the timeline lives in the ASGI scope's state.
STATE_KEY = "lockgate_timeline"


class GuardCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One check by the safety gate (input once; output every `check_every` tokens): when, and its result."""

    direction: str
    start: float
    end: float
    source: str
    action: str
    runs: tuple[StageRun, ...] = ()

    @property
    def label(self) -> str:
        """`direction=source`, as in the `x-lockgate-guard` header."""
        return f"{self.direction}={self.source}"


class RequestTimeline:
    """Where one request's time went, and who and what it was about (see the module docstring)."""

    __slots__ = (
        "_awaiting_outcome",
        "_on_end",
        "arrival",
        "choices",
        "clock",
        "end",
        "error_code",
        "first_release",
        "guard_checks",
        "http_status",
        "key_id",
        "klass",
        "method",
        "model",
        "model_route",
        "outcome",
        "parent_span_id",
        "phases",
        "policy",
        "request_id",
        "response_end",
        "result_cache",
        "route",
        "span_id",
        "stream",
        "tenant",
        "token_times",
        "trace_id",
    )

    def __init__(
        self,
        clock: Clock,
        *,
        trace_id: str,
        parent_span_id: str = "",
        request_id: str = "",
        method: str = "",
        on_end: Callable[[RequestTimeline], None] | None = None,
    ) -> None:
        self.clock = clock
        self.arrival = clock()
        self.trace_id = trace_id
        # The gateway's root span for this request; the client's span (if it sent one) is its parent.
        self.span_id = new_span_id()
        self.parent_span_id = parent_span_id
        self.request_id = request_id
        self.method = method
        self.route = ""
        self.tenant = ""
        self.key_id = ""
        self.model = ""  # name@version
        self.policy = ""  # name@version
        self.klass = ""  # priority class: interactive | batch ("" before it is known)
        self.model_route = ""  # a routed request: the route's decision (`RouteDecision.describe`)
        self.result_cache = ""  # on a request the result cache may answer: hit | miss
        self.stream = False
        self.choices = 1
        self.phases: dict[Phase, tuple[float, float]] = {}
        self.guard_checks: list[GuardCheck] = []
        # Clock time of each engine delta that brought tokens (all choices).
        self.token_times: list[float] = []
        # When a stream's first delta was released to the client (after the output guard's hold-back).
        self.first_release: float | None = None
        self.outcome: Outcome | None = None
        self.http_status = 0
        self.error_code = ""
        self.response_end: float | None = None
        self.end: float | None = None
        self._awaiting_outcome = False
        self._on_end = on_end

    def now(self) -> float:
        """The clock's time now."""
        return self.clock()

    def phase(self, name: Phase, start: float) -> float:
        """Record phase `name` as running from `start` until now; returns now (the next phase's start)."""
        end = self.clock()
        self.phases[name] = (start, end)
        return end

    def duration(self, name: Phase) -> float | None:
        """Seconds phase `name` took (None if the request never reached it)."""
        span = self.phases.get(name)
        return None if span is None else span[1] - span[0]

    def guard_check(self, direction: str, start: float, decision: GuardDecision) -> None:
        """Record one safety-gate check that started at `start` and ended now."""
        runs = decision.result.runs if decision.result is not None else ()
        self.guard_checks.append(
            GuardCheck(
                direction=direction,
                start=start,
                end=self.clock(),
                source=decision.source,
                action=decision.action,
                runs=runs,
            )
        )

    def token(self) -> None:
        """An engine delta with tokens arrived now (called per delta: one float appended)."""
        self.token_times.append(self.clock())

    def released(self) -> None:
        """A stream's first delta passed the output guard now and goes to the client."""
        if self.first_release is None:
            self.first_release = self.clock()

    # -- derived figures ---------------------------------------------------------------------------

    @property
    def first_token(self) -> float | None:
        """When the engine's first token arrived."""
        return self.token_times[0] if self.token_times else None

    @property
    def ttft(self) -> float | None:
        """Time to first token from arrival (auth, quota, input guard and queueing included): for a stream,
        to the first token released to the client (the output guard's hold-back included); for a whole
        answer, to the engine's first token (the client gets every token at the end, which e2e measures)."""
        first = self.first_release if self.first_release is not None else self.first_token
        return None if first is None else first - self.arrival

    def inter_token_gaps(self) -> list[float]:
        """Seconds between consecutive engine deltas of a single-choice request (choices interleave, so none
        for n > 1)."""
        times = self.token_times
        if self.choices != 1:
            return []
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def mean_itl(self) -> float | None:
        """Mean inter-token latency (decode time over the gaps between deltas; None with fewer than two)."""
        times = self.token_times
        if self.choices != 1 or len(times) < 2:
            return None
        return (times[-1] - times[0]) / (len(times) - 1)

    @property
    def decode(self) -> float | None:
        """Seconds from the first token to the last."""
        times = self.token_times
        return times[-1] - times[0] if times else None

    @property
    def e2e(self) -> float | None:
        """Seconds from arrival to the end of the request (None before it ended)."""
        return None if self.end is None else self.end - self.arrival

    def guard_label(self) -> str:
        """What decided, per direction, as in `x-lockgate-guard` (the last check of each direction)."""
        last: dict[str, str] = {}
        for check in self.guard_checks:
            last[check.direction] = check.label
        return "; ".join(last.values())

    # -- the end of the request ----------------------------------------------------------------------

    def expect_outcome(self) -> None:
        """A tracker will report this request's outcome: the request ends only when it has."""
        self._awaiting_outcome = True

    def record_outcome(self, outcome: Outcome) -> None:
        """The request's outcome (reported once by its tracker, or for a request no engine saw)."""
        self.outcome = outcome
        if self.response_end is not None:
            self._ended()

    def response_ended(self, status: int) -> None:
        """The HTTP response ended with `status` (0: none was sent, an unhandled error)."""
        self.http_status = status or 500
        self.response_end = self.clock()
        if not self._awaiting_outcome or self.outcome is not None:
            self._ended()

    def _ended(self) -> None:
        if self.end is not None:
            return
        self.end = self.clock()
        if self._on_end is not None:
            self._on_end(self)


def timeline_in(scope: Any, clock: Clock) -> RequestTimeline:
    """The timeline of the request of this ASGI scope; a detached one (never observed) when the request did
    not pass the observe middleware."""
    state = scope.get("state")
    timeline = state.get(STATE_KEY) if state is not None else None
    if isinstance(timeline, RequestTimeline):
        return timeline
    return RequestTimeline(clock, trace_id=new_trace_id())


def note_error(scope: Any, code: str | None, status: int) -> None:
    """The error a request is answered with (its code, or `http_<status>` without one), for its timeline."""
    state = scope.get("state")
    timeline = state.get(STATE_KEY) if state is not None else None
    if isinstance(timeline, RequestTimeline):
        timeline.error_code = code or f"http_{status}"
