"""Settlement: one request's quota reservation and outcome, settled exactly once however the request ends.

`Settlement` is the context manager around everything after the reservation. A request that ends before an
engine takes it (schema compile error, input guard block or failure, admission refusal, client gone while
queued) gets its whole reservation back; if it was queued, its outcome (`refused`, or `cancelled` when the
client left) is reported too. Once admitted, the request's `RequestTracker` owns the rest: the first end it
hears (completed, blocked, cancelled, error) frees the replica, reports the outcome and settles the quota with
the usage the request had.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from types import TracebackType

from engines.base import EngineRequest, Usage
from gateway.generation.context import Generation
from gateway.generation.flow import ClientDisconnectedError
from gateway.generation.planning import Plan
from gateway.generation.tracking import OutcomeSink, RequestTracker
from gateway.observe.outcome import Outcome, Status
from gateway.observe.timeline import RequestTimeline
from policy.quota.meter import Charge
from routing.scheduler import Lease


def settle_on_outcome(
    gen: Generation,
    charge: Charge,
    release: Callable[[], None] | None = None,
    *,
    prompt_price: float = 1.0,
    completion_price: float = 1.0,
) -> OutcomeSink:
    """The sink for one request: free its engine capacity (`release`), report the outcome, then settle its
    quota with the usage it had (its prompt and completion tokens times their prices: 1, or a result cache
    hit's); in the event loop's next pass, so that what the request still has to send (a whole answer's body,
    a stream's last events) leaves first: the client does not wait for the bookkeeping. Nothing else can run
    before it: a request that arrives meanwhile is read in a later pass, after it."""

    price = gen.config.quota.guard_token_price

    def settle(outcome: Outcome) -> None:
        if release is not None:
            release()
        gen.sink(outcome)
        usage = outcome.usage
        # The output guard's tokens are the tenant's line too: a long answer costs guard work. Charged past
        # the reservation if need be (it covers prompt and max_tokens only): the bucket may go into debt,
        # which later requests wait out, rather than the work going unbilled.
        used = (
            math.ceil(usage.prompt_tokens * prompt_price)
            + math.ceil(usage.completion_tokens * completion_price)
            + math.ceil(usage.guard_tokens * price)
        )
        # The meter's own task, not the request TaskSet: shutdown cancels those, and drains these.
        gen.meter.settle_later(charge, used)

    def sink(outcome: Outcome) -> None:
        asyncio.get_running_loop().call_soon(settle, outcome)

    return sink


class Settlement:
    """The one refund-and-outcome path of a request with a granted reservation (`with Settlement(...)`)."""

    def __init__(self, gen: Generation, plan: Plan, charge: Charge, timeline: RequestTimeline) -> None:
        self._gen = gen
        self._plan = plan
        self._charge = charge
        self._timeline = timeline
        self._queued = False
        # Set once an engine may see the request: from then on it reports the outcome and settles.
        self.tracker: RequestTracker | None = None

    def __enter__(self) -> Settlement:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._end(exc)

    def queued(self) -> None:
        """The request waits for admission: ended before an engine takes it, it reports an outcome."""
        self._queued = True

    def admitted(self, lease: Lease, req: EngineRequest) -> RequestTracker:
        """The request holds `lease` for `req`: its tracker settles it from now on (the lease's release
        included)."""
        sink = settle_on_outcome(self._gen, self._charge, lease.release)
        return self._tracked(req, sink, lease.observe)

    def cached(self, req: EngineRequest, prompt_price: float) -> RequestTracker:
        """The request is answered from the result cache: its tracker settles it from now on, charging
        `prompt_price` of its prompt tokens and none of its (not generated) completion tokens."""
        sink = settle_on_outcome(self._gen, self._charge, prompt_price=prompt_price, completion_price=0.0)
        return self._tracked(req, sink, None)

    def _tracked(
        self, req: EngineRequest, sink: OutcomeSink, on_output: Callable[[int, int], None] | None
    ) -> RequestTracker:
        plan = self._plan
        self.tracker = RequestTracker(
            plan.request_id,
            plan.model.ref,
            len(req.prompt_token_ids),
            plan.stream,
            sink,
            tokenizer=plan.model.tokenizer.ref,
            chat_template=plan.model.chat_template.ref,
            choices=plan.choices,
            metadata=plan.metadata,
            on_output=on_output,
            timeline=self._timeline,
        )
        return self.tracker

    def _end(self, exc: BaseException) -> None:
        gone = isinstance(exc, ClientDisconnectedError)
        if self.tracker is not None:
            # Idempotent: the tracked stream or the output guard has often recorded the end already.
            cancelled = gone or isinstance(exc, asyncio.CancelledError)
            self.tracker.finish("cancelled" if cancelled else "error")
            return
        # Nothing reached an engine: the whole reservation goes back.
        self._gen.meter.settle_later(self._charge, 0)
        if self._queued:
            self._unserved("cancelled" if gone else "refused")

    def _unserved(self, status: Status) -> None:
        """The outcome of a request that never reached an engine (refunded whole: no usage)."""
        plan = self._plan
        outcome = Outcome(
            request_id=plan.request_id,
            model=plan.model.ref,
            status=status,
            finish_reason=None,
            usage=Usage(prompt_tokens=0, completion_tokens=0),
            stream=plan.stream,
            tokenizer=plan.model.tokenizer.ref,
            chat_template=plan.model.chat_template.ref,
            metadata=plan.metadata,
        )
        self._gen.sink(outcome)
        self._timeline.record_outcome(outcome)
