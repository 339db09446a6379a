"""Shared plumbing of the scheduling benchmarks (`ops.bench.fairness`, `ops.bench.overload`): a virtual-time
event loop, simulated replicas, a plain FCFS dispatcher to compare the fair scheduler with, and the client
side of one request (admit, stream, observe, release).

Virtual time: `VirtualTimeLoop` is an asyncio loop whose clock jumps to the next timer whenever nothing is
ready to run, so `asyncio.sleep` (the simulator's steps, Poisson arrivals, `Scheduler.run`) takes no wall
time. Every component takes `loop.time` as its clock; a run of minutes of simulated traffic takes seconds.
"""

from __future__ import annotations

import asyncio
import random
import selectors
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar, cast

from engines.base import EngineRequest, SamplingSpec
from engines.breaker import BreakerPolicy
from engines.simulated import SimulatedEngine, SimulatorConfig
from routing.admission_types import Ticket
from routing.config import ReplicaConfig, RouterConfig
from routing.replicas import Replica
from routing.router import Router, RouteRequest

T = TypeVar("T")
SHA = "5" * 64


class _VirtualSelector:
    """Never blocks: a wait for `timeout` seconds moves the loop's virtual clock instead."""

    def __init__(self, inner: selectors.BaseSelector, loop: VirtualTimeLoop) -> None:
        self._inner = inner
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = self._inner.select(0)
        if not events and timeout is not None and timeout > 0:
            self._loop.advance(timeout)
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock that skips every idle wait (discrete-event simulation)."""

    def __init__(self) -> None:
        super().__init__()
        self._virtual = 0.0
        # The selector is where the loop blocks until its next timer: make that wait a clock jump.
        state = vars(self)
        state["_selector"] = _VirtualSelector(cast(selectors.BaseSelector, state["_selector"]), self)

    def time(self) -> float:
        """Virtual seconds since the loop was made."""
        return self._virtual

    def advance(self, seconds: float) -> None:
        """Move the clock forward (the selector does, when the loop would wait)."""
        self._virtual += seconds


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a fresh `VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)


def now() -> float:
    """The running loop's clock (virtual under `run_virtual`)."""
    return asyncio.get_running_loop().time()


# Step time grows with the batch, as in a real engine; KV capacity bounds concurrency per replica.
ENGINE = SimulatorConfig(
    prefill_s_per_token=0.0001,
    decode_step_s=0.012,
    decode_step_s_per_seq=0.0005,
    kv_capacity_tokens=12_000,
    max_batch=48,
    max_model_len=4096,
)
# The gateway reserves all of max_tokens (cap above any request), as the simulator does: no engine queue.
REPLICA = ReplicaConfig(growth_reserve_cap=4096, breaker=BreakerPolicy(threshold=3, cooldown=15.0))


async def start_replicas(
    count: int, config: SimulatorConfig = ENGINE, replica: ReplicaConfig = REPLICA
) -> list[Replica]:
    """`count` started simulated replicas on the loop's clock, their capacity and sequence limit known
    without a refresh."""
    loop = asyncio.get_running_loop()
    replicas = []
    for i in range(count):
        engine = SimulatedEngine(config, replica_id=f"sim-{i}", clock=loop.time)
        await engine.start()
        replicas.append(
            Replica(
                engine,
                pool="default",
                weights_sha256=SHA,
                config=replica,
                clock=loop.time,
                kv_budget_tokens=config.kv_capacity_tokens,
            )
        )
    await asyncio.gather(*(r.refresh() for r in replicas))
    return replicas


async def stop_replicas(replicas: Sequence[Replica]) -> None:
    """Shut every simulated engine down."""
    for replica in replicas:
        await replica.engine.shutdown()


def router() -> Router:
    """The router both dispatchers use (random prompts: affinity plays no part)."""
    return Router(RouterConfig(prefix_weight=0.0, session_weight=0.0))


class LeaseLike(Protocol):
    """What a request holds while it runs: `Lease` or `FifoLease`."""

    replica: Replica

    def observe(self, tokens: int) -> None:
        """Tokens generated."""

    def release(self) -> None:
        """The request ended."""


class Dispatcher(Protocol):
    """`Scheduler` or `FifoDispatcher`."""

    async def admit(self, ticket: Ticket, route: RouteRequest) -> Any:
        """Wait for a replica with room."""


class FifoLease:
    """A request dispatched by `FifoDispatcher`."""

    def __init__(self, owner: FifoDispatcher, rid: str, replica: Replica) -> None:
        self._owner = owner
        self._rid = rid
        self.replica = replica
        self._released = False

    def observe(self, tokens: int) -> None:
        """Count output against the replica's KV budget."""
        self.replica.grow(self._rid, tokens)

    def release(self) -> None:
        """Free the budget and dispatch what now fits (idempotent)."""
        if not self._released:
            self._released = True
            self.replica.release(self._rid)
            self._owner.dispatch()


class FifoDispatcher:
    """The baseline: one unbounded first-come first-served queue over the same replicas and router; no
    tenants, classes, deadlines or bounds."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self.replicas = list(replicas)
        self._router = router()
        self._queue: deque[tuple[RouteRequest, asyncio.Future[FifoLease]]] = deque()

    def depth(self) -> int:
        """Requests waiting."""
        return len(self._queue)

    async def admit(self, ticket: Ticket, route: RouteRequest) -> FifoLease:
        """Queue the request and wait for its turn and a replica with room."""
        future: asyncio.Future[FifoLease] = asyncio.get_running_loop().create_future()
        self._queue.append((route, future))
        self.dispatch()
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.result().release()
            raise

    def dispatch(self) -> None:
        """Dispatch the head while a replica has room for it (head-of-line blocking, as strict FCFS is)."""
        while self._queue:
            route, future = self._queue[0]
            if future.cancelled():
                self._queue.popleft()
                continue
            replica = self._router.dispatch(route, self.replicas, now())
            if replica is None:
                return
            self._queue.popleft()
            future.set_result(FifoLease(self, route.request_id, replica))


class Workload:
    """Random request shapes from one seed."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self._next = 0

    def request(
        self, tenant: str, weight: float, klass: str, prompt: int, max_tokens: int, deadline: float
    ) -> tuple[Ticket, RouteRequest]:
        """A ticket and its route for a new request arriving now."""
        self._next += 1
        rid = f"{tenant}-{self._next}"
        start = self.rng.randrange(1_000_000)
        arrival = now()
        ticket = Ticket(
            request_id=rid,
            tenant=tenant,
            tenant_weight=weight,
            klass="batch" if klass == "batch" else "interactive",
            arrival=arrival,
            deadline=arrival + deadline,
            prompt_tokens=prompt,
            max_tokens=max_tokens,
        )
        route = RouteRequest(
            request_id=rid,
            weights_sha256=SHA,
            prompt_token_ids=tuple(range(start, start + prompt)),
            max_tokens=max_tokens,
        )
        return ticket, route


class Served:
    """What one served request saw: when its first token came, when it ended, how many tokens it got."""

    __slots__ = ("done", "first", "tokens")

    def __init__(self) -> None:
        self.first: float | None = None
        self.done: float | None = None
        self.tokens = 0


async def serve(
    lease: LeaseLike,
    route: RouteRequest,
    served: Served,
    on_tokens: Callable[[int], None] | None = None,
) -> Served:
    """Stream the request from its lease's replica, observing every token; release the lease however it
    ends."""
    request = EngineRequest(
        request_id=route.request_id,
        prompt_token_ids=route.prompt_token_ids,
        sampling=SamplingSpec(max_tokens=route.max_tokens, ignore_eos=True),
    )
    try:
        async for delta in lease.replica.engine.generate(request):
            n = len(delta.token_ids)
            if n:
                if served.first is None:
                    served.first = now()
                served.tokens += n
                lease.observe(n)
                if on_tokens is not None:
                    on_tokens(n)
        served.done = now()
    finally:
        lease.release()
    return served
