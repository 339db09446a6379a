"""The fair admission queue: order, fairness bound, queue-age guard, deadlines, bounds, service rate, removal.

Every test drives the queue with an explicit clock value; nothing sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import retry_after_headers
from routing.admission_types import (
    CLASSES,
    AdmissionConfig,
    AdmissionError,
    DeadlineUnmeetableError,
    Klass,
    QueueFullError,
    Ticket,
)
from routing.fair_queue import FairQueue, WaitCalibration

FAR = 1e9
# A rate so high that predicted waits are ~0: tests of order are not disturbed by deadline refusals.
FAST = 1e12


def config(**overrides: float) -> AdmissionConfig:
    fields: dict[str, float] = {
        "initial_service_rate": FAST,
        "max_queued_per_class": 100_000,
        "max_queued_per_tenant": 100_000,
    }
    fields.update(overrides)
    return msgspec.convert(fields, AdmissionConfig)


_ids = iter(range(10**9))


def ticket(
    tenant: str = "a",
    *,
    weight: float = 1.0,
    klass: Klass = "interactive",
    arrival: float = 0.0,
    deadline: float = FAR,
    prompt: int = 10,
    max_tokens: int = 10,
    request_id: str | None = None,
) -> Ticket:
    return Ticket(
        request_id=request_id or f"r{next(_ids)}",
        tenant=tenant,
        tenant_weight=weight,
        klass=klass,
        arrival=arrival,
        deadline=deadline,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
    )


def serve(queue: FairQueue, now: float = 0.0, output: int | None = None) -> Ticket:
    """Pop one ticket, charge its whole output (max_tokens unless given) and finish it."""
    popped = queue.pop(now)
    assert popped is not None
    queue.charge_output(popped.tenant, popped.max_tokens if output is None else output)
    queue.finish(popped.request_id)
    return popped


def test_config_refuses_unknown_fields_and_bad_values() -> None:
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"w_inn": 1.0}, AdmissionConfig)
    with pytest.raises(msgspec.ValidationError, match="w_out must be > 0"):
        msgspec.convert({"w_out": 0}, AdmissionConfig)
    cfg = AdmissionConfig()
    assert cfg.default_deadline("interactive", 5.0) == 15.0
    assert cfg.default_deadline("batch", 5.0) == 305.0


# -- fairness between tenants --------------------------------------------------------------------------


@st.composite
def gap_scenario(draw: st.DrawFn) -> tuple[list[float], list[list[tuple[int, int, int]]], int, list[int]]:
    n = draw(st.integers(2, 4))
    weights = draw(st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 7.5]), min_size=n, max_size=n))
    sized = st.tuples(st.integers(0, 60), st.integers(1, 60), st.floats(0, 1))
    streams = [
        [(p, m, round(m * f)) for p, m, f in draw(st.lists(sized, min_size=3, max_size=25))] for _ in range(n)
    ]
    concurrency = draw(st.integers(1, 3))
    choices = draw(st.lists(st.integers(0, 10**6), min_size=400, max_size=400))
    return weights, streams, concurrency, choices


@settings(max_examples=200, deadline=None)
@given(gap_scenario())
def test_service_gap_between_backlogged_tenants_is_bounded(
    scenario: tuple[list[float], list[list[tuple[int, int, int]]], int, list[int]],
) -> None:
    """|S_A/w_A - S_B/w_B| <= M + (k - 1) x O at every step.

    M = the largest request cost (prompt x w_in + max_tokens x w_out) / the smallest weight, O = the largest
    output reserve cost / the smallest weight, k = requests in flight at once.
    """
    weights, streams, concurrency, choices = scenario
    cfg = config()
    queue = FairQueue(cfg)
    tenants = [f"t{i}" for i in range(len(weights))]
    outputs: dict[str, int] = {}
    for name, weight, stream in zip(tenants, weights, streams, strict=True):
        for prompt, max_tokens, output in stream:
            t = ticket(name, weight=weight, prompt=prompt, max_tokens=max_tokens)
            outputs[t.request_id] = output
            queue.push(t, 0.0)
    min_w = min(weights)
    cost = max(p * cfg.w_in + m * cfg.w_out for stream in streams for p, m, _ in stream) / min_w
    out = max(m * cfg.w_out for stream in streams for _, m, _ in stream) / min_w
    bound = cost + (concurrency - 1) * out + 1e-9
    served = dict.fromkeys(tenants, 0.0)
    weight_of = dict(zip(tenants, weights, strict=True))
    flying: list[tuple[Ticket, int]] = []
    for choice in choices:
        if any(queue.share(name).queued == 0 for name in tenants):
            break  # the bound is about tenants that stay backlogged
        if len(flying) < concurrency and (not flying or choice % 2):
            popped = queue.pop(0.0)
            assert popped is not None
            served[popped.tenant] += popped.prompt_tokens * cfg.w_in / weight_of[popped.tenant]
            flying.append((popped, outputs[popped.request_id]))
        else:
            index = choice % len(flying)
            t, left = flying[index]
            chunk = min(left, 1 + choice % 17)
            queue.charge_output(t.tenant, chunk)
            served[t.tenant] += chunk * cfg.w_out / weight_of[t.tenant]
            if left - chunk == 0:
                queue.finish(t.request_id)
                del flying[index]
            else:
                flying[index] = (t, left - chunk)
        assert max(served.values()) - min(served.values()) <= bound
        for name in tenants:
            assert queue.share(name).counter == pytest.approx(served[name])


def test_weighted_shares_converge_to_weights() -> None:
    queue = FairQueue(config())
    for _ in range(600):
        queue.push(ticket("light", weight=1.0), 0.0)
        queue.push(ticket("heavy", weight=3.0), 0.0)
    tokens = {"light": 0, "heavy": 0}
    for _ in range(400):
        t = serve(queue)
        tokens[t.tenant] += t.work
    assert tokens["heavy"] / tokens["light"] == pytest.approx(3.0, rel=0.02)


def test_idle_tenant_cannot_bank_credit() -> None:
    cfg = config()
    queue = FairQueue(cfg)
    request_cost = 10 * cfg.w_in + 10 * cfg.w_out
    # b is served a little, then idles while a is served a lot.
    queue.push(ticket("b"), 0.0)
    serve(queue)
    for _ in range(200):
        queue.push(ticket("a"), 0.0)
    for _ in range(100):
        serve(queue)
    # a started at the virtual time b had reached (one request), and then was served 100.
    assert queue.share("a").counter == pytest.approx(101 * request_cost)
    for _ in range(100):
        queue.push(ticket("b"), 0.0)
    # Lifted to a's counter: the 99 requests' worth of idle time is not banked.
    assert queue.share("b").counter == queue.share("a").counter
    start = {"a": queue.share("a").counter, "b": queue.share("b").counter}
    counts = {"a": 0, "b": 0}
    for _ in range(100):
        t = serve(queue)
        counts[t.tenant] += 1
        gap = (queue.share("b").counter - start["b"]) - (queue.share("a").counter - start["a"])
        assert gap <= request_cost
    assert abs(counts["a"] - counts["b"]) <= 1


def test_returning_tenant_is_lifted_to_the_least_served_active_tenant() -> None:
    cfg = config()
    queue = FairQueue(cfg)
    # a has one request in flight (nothing queued): it is active and its counter counts.
    queue.push(ticket("a"), 0.0)
    flying = queue.pop(0.0)
    assert flying is not None
    queue.charge_output("a", 5)
    # b is backlogged and was served more than a.
    for _ in range(3):
        queue.push(ticket("b"), 0.0)
    queue.charge_output("b", 100)
    assert queue.share("b").counter > queue.share("a").counter
    queue.push(ticket("c"), 0.0)
    assert queue.share("c").counter == queue.share("a").counter == 10 * cfg.w_in + 5 * cfg.w_out
    # Once a finishes and everyone idles, nobody restarts below the virtual time reached.
    queue.finish(flying.request_id)
    while len(queue):
        serve(queue)
    level = min(queue.share("b").counter, queue.share("c").counter)
    queue.push(ticket("new"), 1.0)
    assert queue.share("new").counter >= level


# -- priority classes and the queue-age guard ----------------------------------------------------------


def test_interactive_before_batch() -> None:
    queue = FairQueue(config(batch_max_wait=30.0))
    queue.push(ticket("a", klass="batch", arrival=0.0), 0.0)
    queue.push(ticket("b", klass="interactive", arrival=1.0), 1.0)
    first = queue.pop(2.0)
    assert first is not None
    assert first.klass == "interactive"


def test_batch_is_served_under_sustained_interactive_load() -> None:
    max_wait, step = 5.0, 0.5
    queue = FairQueue(config(batch_max_wait=max_wait))
    waits: list[float] = []
    interactive_served = 0
    now = 0.0
    for i in range(400):
        now = i * step
        # Interactive never runs dry; a batch ticket arrives every 2 s.
        while queue.depth("interactive") < 3:
            queue.push(ticket("chatty", arrival=now), now)
        if i % 4 == 0:
            queue.push(ticket("bulk", klass="batch", arrival=now), now)
        t = serve(queue, now)
        if t.klass == "batch":
            waits.append(now - t.arrival)
            assert now - t.arrival >= max_wait  # batch only overtakes once aged
        else:
            interactive_served += 1
    assert len(waits) >= 95  # of the 100 batch arrivals, all but those not yet aged
    assert max(waits) <= max_wait + step
    assert interactive_served >= 290
    # None left behind: every batch ticket still queued is younger than max_wait.
    left = [t for t in iter(lambda: queue.pop(now), None) if t.klass == "batch"]
    assert left
    assert all(now - t.arrival < max_wait for t in left)


# -- order within a tenant -----------------------------------------------------------------------------


def test_earliest_deadline_first_within_a_tenant_ties_fifo() -> None:
    queue = FairQueue(config())
    pushed = [ticket("a", deadline=d, request_id=f"d{d}-{i}") for i, d in enumerate([50, 30, 30, 90, 10])]
    for t in pushed:
        queue.push(t, 0.0)
    order = [serve(queue).request_id for _ in pushed]
    assert order == ["d10-4", "d30-1", "d30-2", "d50-0", "d90-3"]


# -- deadlines -----------------------------------------------------------------------------------------


def test_unmeetable_deadline_is_refused_at_push_with_retry_after() -> None:
    queue = FairQueue(config(initial_service_rate=100.0))
    for _ in range(10):
        queue.push(ticket("flood", prompt=50, max_tokens=50), 0.0)
    late = ticket("flood", deadline=5.0)
    assert queue.predicted_wait(late) == pytest.approx(10.0)
    with pytest.raises(DeadlineUnmeetableError) as refused:
        queue.push(late, 0.0)
    assert refused.value.retry_after == pytest.approx(5.0)
    assert refused.value.predicted_wait == pytest.approx(10.0)
    assert refused.value.status_code == 503
    assert retry_after_headers(refused.value.retry_after)["Retry-After"] == "5"
    # Another tenant is served by its fair share, not behind the flood: admitted.
    other = ticket("other", deadline=5.0)
    assert queue.predicted_wait(other) == 0.0
    queue.push(other, 0.0)
    # A batch ticket waits behind all interactive work (10 s at 100 tokens/s).
    with pytest.raises(DeadlineUnmeetableError):
        queue.push(ticket("other", klass="batch", deadline=9.0), 0.0)
    assert len(queue) == 11


def test_fair_share_prediction_scales_with_weights() -> None:
    queue = FairQueue(config(initial_service_rate=100.0))
    for _ in range(10):
        queue.push(ticket("a", weight=1.0, prompt=50, max_tokens=50), 0.0)
        queue.push(ticket("b", weight=3.0, prompt=50, max_tokens=50), 0.0)
    # a holds 1000 tokens at a 1/4 share: 4000 tokens served first, capped by the class's 2000.
    assert queue.predicted_wait(ticket("a")) == pytest.approx(20.0)
    # b holds 1000 tokens at a 3/4 share: 1333 tokens served first.
    assert queue.predicted_wait(ticket("b", weight=3.0)) == pytest.approx(1000 * 4 / 3 / 100)


def test_expired_tickets_are_removed_by_expire_and_never_popped() -> None:
    queue = FairQueue(config())
    soon = ticket("a", deadline=5.0)
    later = ticket("a", deadline=20.0)
    exact = ticket("a", deadline=6.0)
    for t in (soon, later, exact):
        queue.push(t, 0.0)
    first = queue.pop(6.0)  # soon's deadline passed; exact's deadline is now: still dispatchable
    assert first is not None
    assert first.request_id == exact.request_id
    assert queue.expire(6.0) == [soon]
    assert queue.expire(6.0) == []
    assert queue.pop(21.0) is None
    assert queue.expire(21.0) == [later]
    assert len(queue) == 0
    assert queue.share("a").queued == 0
    assert queue.share("a").in_flight == 1


# -- bounds --------------------------------------------------------------------------------------------


def test_bounds_per_tenant_and_per_class() -> None:
    queue = FairQueue(config(max_queued_per_tenant=2, max_queued_per_class=3, initial_service_rate=100.0))
    queue.push(ticket("a"), 0.0)
    queue.push(ticket("a", klass="batch"), 0.0)
    with pytest.raises(QueueFullError) as tenant_full:
        queue.push(ticket("a"), 0.0)
    assert tenant_full.value.reason == "max_queued_per_tenant"
    assert tenant_full.value.status_code == 429
    assert tenant_full.value.retry_after > 0
    queue.push(ticket("b"), 0.0)
    queue.push(ticket("c"), 0.0)
    with pytest.raises(QueueFullError) as class_full:
        queue.push(ticket("d"), 0.0)
    assert class_full.value.reason == "max_queued_per_class"
    assert class_full.value.status_code == 503
    assert class_full.value.retry_after == pytest.approx(20 / 100)
    assert isinstance(class_full.value, AdmissionError)
    queue.push(ticket("d", klass="batch"), 0.0)  # the other class has room
    assert (queue.depth("interactive"), queue.depth("batch"), len(queue)) == (3, 2, 5)


# -- service rate --------------------------------------------------------------------------------------


def test_service_rate_follows_record_service_and_drives_prediction() -> None:
    queue = FairQueue(config(initial_service_rate=1000.0, service_rate_halflife=1.0))
    probe = ticket("a")
    assert queue.service_rate == 1000.0
    for i in range(200):  # back to back, one at a time: 25 tokens every 0.1 s
        served(queue, i * 0.1, (i + 1) * 0.1, 25.0)
    assert queue.service_rate == pytest.approx(250.0, rel=1e-3)
    for _ in range(10):
        queue.push(ticket("a", prompt=50, max_tokens=50), 20.0)
    assert queue.predicted_wait(probe) == pytest.approx(4.0, rel=1e-3)  # 1,000 tokens ahead


def served(queue: FairQueue, start: float, end: float, tokens: float) -> None:
    """One request in flight from `start` to `end` (nothing else queued), reporting `tokens` of work."""
    t = ticket("a", prompt=int(tokens), max_tokens=1)
    queue.start(t, start)
    queue.finish(t.request_id)
    queue.record_service(tokens, end)


def test_service_is_timed_while_requests_are_in_flight_and_idle_time_never_counts() -> None:
    queue = FairQueue(config(initial_service_rate=1000.0, service_rate_halflife=1.0))
    for i in range(100):  # 0.4 s of service, then 0.6 s with nothing in flight
        served(queue, float(i), i + 0.4, 100.0)
    # 100 tokens per 0.4 s busy: 250/s (timing the gaps between reports would make it 100/s).
    assert queue.service_rate == pytest.approx(250.0, rel=1e-3)
    # A long silence with nothing in flight is idle, however long.
    served(queue, 1000.0, 1000.4, 100.0)
    assert queue.service_rate == pytest.approx(250.0, rel=1e-3)


def test_a_slow_engines_long_generations_count_whole_and_refuse_what_cannot_meet_its_deadline() -> None:
    queue = FairQueue(config(initial_service_rate=1000.0, service_rate_halflife=10.0))
    for i in range(20):  # one request at a time, each 8 s long: 400 tokens per 8 s
        served(queue, i * 8.0, (i + 1) * 8.0, 400.0)
    assert queue.service_rate == pytest.approx(50.0, rel=0.01)
    now = 160.0
    for _ in range(5):
        queue.push(ticket("a", prompt=50, max_tokens=50, deadline=now + 100.0), now)
    # 500 tokens ahead at 50/s: 10 s, more than this ticket may wait.
    with pytest.raises(DeadlineUnmeetableError) as refused:
        queue.push(ticket("a", deadline=now + 9.0), now)
    assert refused.value.predicted_wait == pytest.approx(10.0, rel=0.01)


def test_the_prior_rate_fades_within_the_first_seconds_of_service() -> None:
    queue = FairQueue(config(initial_service_rate=1000.0, service_rate_halflife=10.0))
    for i in range(100):  # 10 s of service at 100 tokens/s: a CPU engine ten times slower than the prior
        served(queue, i * 0.1, (i + 1) * 0.1, 10.0)
    # The prior weighs as one second of service: 1.6x the rate now (as a half-life, 10 s, it was 4.7x).
    assert 100.0 < queue.service_rate < 170.0


def test_a_request_held_without_progress_counts_at_most_service_idle_gap() -> None:
    queue = FairQueue(config(initial_service_rate=1000.0, service_rate_halflife=1.0, service_idle_gap=2.0))
    for i in range(100):
        served(queue, i * 0.1, (i + 1) * 0.1, 25.0)
    served(queue, 10.0, 1010.0, 500.0)  # in flight for 1000 s (a slow reader): 2 s of it count
    assert queue.service_rate == pytest.approx(250.0, rel=1e-3)


# -- removal and consistency ---------------------------------------------------------------------------


def test_start_is_a_push_and_a_pop_with_nothing_queued() -> None:
    cfg = config()
    started, pushed = FairQueue(cfg), FairQueue(cfg)
    for queue in (started, pushed):
        # Tenant "a" was served and is still in flight: "b" starts at the virtual time, a's counter.
        queue.push(ticket("a", request_id="served"), 0.0)
        serve(queue, output=50)
        queue.push(ticket("a", request_id="held", arrival=1.0), 1.0)
        assert queue.pop(1.0) is not None
    late = ticket("b", weight=2.0, request_id="b1", arrival=1.0, prompt=30)
    started.start(late, 1.0)
    pushed.push(late, 1.0)
    assert pushed.pop(1.0) == late
    for queue in (started, pushed):
        assert len(queue) == 0
        assert queue.share("b").in_flight == 1
    ahead = pushed.share("a").counter + 30 * cfg.w_in / 2.0
    assert started.share("b").counter == pushed.share("b").counter == ahead
    # Refused as a push is; never ahead of a queued ticket.
    with pytest.raises(ValueError, match="already queued or in flight"):
        started.start(late, 1.0)
    with pytest.raises(DeadlineUnmeetableError):
        started.start(ticket("c", arrival=1.0, deadline=0.5), 1.0)
    started.push(ticket("c", arrival=1.0), 1.0)
    with pytest.raises(ValueError, match="tickets are queued"):
        started.start(ticket("d", arrival=1.0), 1.0)


def test_remove_at_any_position() -> None:
    queue = FairQueue(config())
    pushed = [ticket("a", deadline=float(d)) for d in range(1, 8)]
    for t in pushed:
        queue.push(t, 0.0)
    for index in (3, 0, 6):  # middle, first, last
        assert queue.remove(pushed[index].request_id) == pushed[index]
    assert queue.remove(pushed[0].request_id) is None
    assert pushed[0].request_id not in queue
    assert queue.share("a").queued == 4
    assert [serve(queue).request_id for _ in range(4)] == [pushed[i].request_id for i in (1, 2, 4, 5)]
    assert queue.pop(0.0) is None
    again = ticket("a")
    queue.push(again, 0.0)
    with pytest.raises(ValueError, match="already"):
        queue.push(again, 0.0)


@dataclass
class Reference:
    """The same scheme by brute force: scans instead of heaps, no forgetting of idle tenants."""

    cfg: AdmissionConfig
    queued: dict[str, tuple[Ticket, int]] = field(default_factory=dict)
    in_flight: dict[str, str] = field(default_factory=dict)
    counter: dict[str, float] = field(default_factory=dict)
    weight: dict[str, float] = field(default_factory=dict)
    tseq: dict[str, int] = field(default_factory=dict)
    vtime: float = 0.0
    seq: int = 0
    expired: list[Ticket] = field(default_factory=list)

    def active(self) -> set[str]:
        return {t.tenant for t, _ in self.queued.values()} | set(self.in_flight.values())

    def sample(self, extra: set[str]) -> None:
        active = self.active() | extra
        if active:
            self.vtime = max(self.vtime, min(self.counter[t] for t in active))

    def push(self, t: Ticket) -> str | None:
        if sum(q.klass == t.klass for q, _ in self.queued.values()) >= self.cfg.max_queued_per_class:
            return "max_queued_per_class"
        if sum(q.tenant == t.tenant for q, _ in self.queued.values()) >= self.cfg.max_queued_per_tenant:
            return "max_queued_per_tenant"
        if t.tenant not in self.active():
            self.sample(set())
            self.counter[t.tenant] = max(self.counter.get(t.tenant, 0.0), self.vtime)
            self.seq += 1
            self.tseq[t.tenant] = self.seq
        self.weight[t.tenant] = t.tenant_weight
        self.seq += 1
        self.queued[t.request_id] = (t, self.seq)
        return None

    def unqueue(self, rid: str) -> Ticket:
        t, _ = self.queued.pop(rid)
        if t.tenant not in self.active():
            self.sample({t.tenant})
        return t

    def collect(self, now: float) -> None:
        late = sorted((s for t, s in self.queued.values() if t.deadline < now))
        by_seq = {s: rid for rid, (_, s) in self.queued.items()}
        for s in sorted(late, key=lambda s: (self.queued[by_seq[s]][0].deadline, s)):
            self.expired.append(self.unqueue(by_seq[s]))

    def pop(self, now: float) -> Ticket | None:
        self.collect(now)
        by_class = {k: [(t, s) for t, s in self.queued.values() if t.klass == k] for k in CLASSES}
        batch, interactive = by_class["batch"], by_class["interactive"]
        if batch and (not interactive or now - min(t.arrival for t, _ in batch) >= self.cfg.batch_max_wait):
            waiting = batch
        elif interactive:
            waiting = interactive
        else:
            return None
        tenant = min({t.tenant for t, _ in waiting}, key=lambda n: (self.counter[n], self.tseq[n]))
        t, _ = min(((t, s) for t, s in waiting if t.tenant == tenant), key=lambda e: (e[0].deadline, e[1]))
        self.in_flight[t.request_id] = tenant
        self.queued.pop(t.request_id)
        self.counter[tenant] += t.prompt_tokens * self.cfg.w_in / self.weight[tenant]
        return t

    def finish(self, rid: str) -> None:
        tenant = self.in_flight.pop(rid)
        if tenant not in self.active():
            self.sample({tenant})


TENANTS = ["a", "b", "c"]
operation = st.one_of(
    st.tuples(
        st.just("push"),
        st.sampled_from(TENANTS),
        st.sampled_from([0.5, 1.0, 3.0]),
        st.sampled_from(CLASSES),
        st.integers(1, 40),
        st.integers(0, 30),
    ),
    st.tuples(st.just("pop"), st.integers(0, 3)),
    st.tuples(
        st.just("start"), st.sampled_from(TENANTS), st.sampled_from([0.5, 1.0, 3.0]), st.integers(0, 30)
    ),
    st.tuples(st.just("remove"), st.integers(0, 10**6)),
    st.tuples(st.just("expire"), st.integers(0, 3)),
    st.tuples(st.just("finish"), st.integers(0, 10**6)),
    st.tuples(st.just("charge"), st.integers(0, 10**6), st.integers(1, 30)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(operation, max_size=120))
def test_heaps_agree_with_a_brute_force_model(ops: list[tuple[object, ...]]) -> None:
    cfg = config(batch_max_wait=6.0, max_queued_per_class=8, max_queued_per_tenant=5)
    queue, model = FairQueue(cfg), Reference(cfg)
    now = 0.0
    for op in ops:
        match op:
            case ("push", str(tenant), float(weight), klass, int(deadline_in), int(prompt)):
                assert klass in CLASSES
                t = ticket(tenant, weight=weight, klass=klass, arrival=now, deadline=now + deadline_in)
                t = msgspec.structs.replace(t, prompt_tokens=prompt)
                expected = model.push(t)
                if expected is None:
                    queue.push(t, now)
                else:
                    with pytest.raises(QueueFullError, match=expected):
                        queue.push(t, now)
            case ("start", str(tenant), float(weight), int(prompt)) if not model.queued:
                # Straight to in flight with nothing queued: what a push and then a pop do.
                t = ticket(tenant, weight=weight, arrival=now, deadline=now + 5, prompt=prompt)
                assert model.push(t) is None
                assert model.pop(now) == t
                queue.start(t, now)
                assert queue.share(tenant).in_flight == sum(n == tenant for n in model.in_flight.values())
            case ("pop", int(dt)):
                now += dt
                popped = queue.pop(now)
                reference = model.pop(now)
                assert popped == reference
            case ("remove", int(pick)) if model.queued:
                rid = sorted(model.queued)[pick % len(model.queued)]
                assert queue.remove(rid) == model.unqueue(rid)
            case ("expire", int(dt)):
                now += dt
                model.collect(now)
                got = queue.expire(now)
                assert sorted(t.request_id for t in got) == sorted(t.request_id for t in model.expired)
                model.expired.clear()
            case ("finish", int(pick)) if model.in_flight:
                rid = sorted(model.in_flight)[pick % len(model.in_flight)]
                queue.finish(rid)
                model.finish(rid)
            case ("charge", int(pick), int(tokens)) if model.in_flight:
                tenant = model.in_flight[sorted(model.in_flight)[pick % len(model.in_flight)]]
                queue.charge_output(tenant, tokens)
                model.counter[tenant] += tokens * cfg.w_out / model.weight[tenant]
            case _:
                pass
        assert len(queue) == len(model.queued)
        for klass in CLASSES:
            assert queue.depth(klass) == sum(t.klass == klass for t, _ in model.queued.values())
        for tenant in TENANTS:
            assert queue.share(tenant).queued == sum(t.tenant == tenant for t, _ in model.queued.values())
        for tenant in model.active():
            assert queue.share(tenant).counter == model.counter[tenant]


def test_the_calibration_tracks_a_high_quantile_of_actual_over_predicted_wait() -> None:
    calibration = WaitCalibration()
    assert calibration.factor == 1.0
    for _ in range(100):
        for ratio in range(1, 21):  # actual waits 1x to 20x the predicted, evenly
            calibration.observe(1.0, float(ratio))
    # The 95th percentile of 1..20 is 19-20.
    assert 17.0 < calibration.factor < 21.0
    for _ in range(2000):
        calibration.observe(1.0, 0.1)  # predictions became pessimistic: the factor comes down, bounded
    assert calibration.factor == pytest.approx(0.5)


def test_waits_longer_than_predicted_make_later_predictions_longer() -> None:
    queue = FairQueue(config())
    now = 0.0
    # Each ticket is predicted to wait 1 s (the engine's first request in flight ends then; nothing queued
    # ahead), but is popped only after 5 s.
    for i in range(60):
        queue.push(ticket(request_id=f"r{i}", arrival=now, deadline=now + 100.0), now, first_free=1.0)
        now += 5.0
        assert queue.pop(now) is not None
        queue.finish(f"r{i}")
    assert queue.calibration.factor > 3.0
    # A ticket whose raw prediction (1 s) fits its 2 s deadline is refused: calibrated, it does not.
    with pytest.raises(DeadlineUnmeetableError):
        queue.push(ticket(request_id="late", arrival=now, deadline=now + 2.0), now, first_free=1.0)
    # Expired tickets count too: they waited at least until their deadline.
    other = FairQueue(config())
    for i in range(60):
        other.push(ticket(request_id=f"e{i}", arrival=0.0, deadline=3.0), 0.0, first_free=0.5)
    assert len(other.expire(10.0)) == 60
    assert other.calibration.factor > 3.0
