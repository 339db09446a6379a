"""The fair admission queue's types: its config (`AdmissionConfig`), what it queues (`Ticket`), its refusals.

The config and the ticket are msgspec Structs: the config is decoded from the gateway's config file (unknown
fields refused), the ticket is built by the scheduler when a request arrives. Times are seconds on the
scheduler's injected clock. The queue itself is `routing.fair_queue.FairQueue`.

Exceptions::

    AdmissionError                 base; `status_code`, `code` and `retry_after` for the HTTP answer
    ├── QueueFullError             a bound is reached (`reason`: max_queued_per_class | max_queued_per_tenant)
    └── DeadlineUnmeetableError    the predicted wait exceeds the ticket's deadline
"""

from __future__ import annotations

from typing import Literal

import msgspec

Klass = Literal["interactive", "batch"]
# Priority order: a class earlier in this tuple is served first (subject to the batch queue-age guard).
CLASSES: tuple[Klass, ...] = ("interactive", "batch")


class TenantShare(msgspec.Struct, frozen=True, kw_only=True):
    """Where one tenant stands in one fair queue (`GET /admin/tenants/{id}/admission`)."""

    # Its requests waiting (both classes) and those dispatched and not yet finished.
    queued: int
    in_flight: int
    # Its virtual token counter (weighted tokens served, over its weight) and the queue's virtual time: a
    # tenant whose counter is ahead waits while tenants behind it are served.
    counter: float
    virtual_time: float


class AdmissionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bounds, weights and timing of the fair admission queue (`routing.fair_queue.FairQueue`)."""

    # Cost of one prompt token in a tenant's virtual token counter.
    w_in: float = 1.0
    # Cost of one generated token. Above w_in because a decode token takes a sequential forward step and keeps
    # its KV cache held for the rest of the answer, while prompt tokens are prefilled in parallel; 2 is a
    # conservative middle (API price lists put output at 2-5x input).
    w_out: float = 2.0
    # Queue deadline in seconds after arrival for an interactive request that names none: past it the
    # request is answered 504 `deadline_expired` instead of being dispatched.
    interactive_deadline: float = 10.0
    # Queue deadline in seconds after arrival for a batch request that names none.
    batch_deadline: float = 300.0
    # Queue-age guard: while a batch ticket has waited this many seconds or more, batch is served before
    # interactive, so batch is never starved by sustained interactive load.
    batch_max_wait: float = 30.0
    # Most tickets waiting in one priority class; past it `push` refuses (503 `queue_full`).
    max_queued_per_class: int = 2048
    # Most tickets waiting for one tenant, both classes together; past it `push` refuses (429 `queue_full`).
    max_queued_per_tenant: int = 256
    # Service rate (tokens per second: prompt plus generated tokens) assumed before any work was measured;
    # it predicts queue waits until `record_service` reports real work, and fades out as it does.
    initial_service_rate: float = 1000.0
    # Half-life in seconds (of busy time) of the service-rate estimate: how fast old measurements fade.
    service_rate_halflife: float = 10.0
    # Service is timed while requests are in flight (time with none in flight is idle and never counts); one
    # stretch between two `record_service` reports counts at most this many seconds (requests held in flight
    # without progress: slow readers, a stalled engine). Longer than the longest wait between two finishing
    # requests of a busy engine: a slow engine's long generations may finish many seconds apart.
    service_idle_gap: float = 30.0
    # Fleet-wide fairness (`routing.fairness`): the tenants' virtual token counters shared by every gateway
    # process through Redis, synced every `fleet_sync_interval` seconds. "redis": in the quota store's
    # Redis; "none": each process's fairness is its own; "auto": "redis" when the quota store is Redis and a
    # replica is remote (gateways that share engines), else "none".
    fleet_fairness: Literal["auto", "redis", "none"] = "auto"
    # Seconds between two syncs: the fleet-wide fairness bound grows by the service of this long.
    fleet_sync_interval: float = 0.1

    def __post_init__(self) -> None:
        positive = {
            "w_in": self.w_in,
            "w_out": self.w_out,
            "interactive_deadline": self.interactive_deadline,
            "batch_deadline": self.batch_deadline,
            "initial_service_rate": self.initial_service_rate,
            "service_rate_halflife": self.service_rate_halflife,
            "service_idle_gap": self.service_idle_gap,
            "fleet_sync_interval": self.fleet_sync_interval,
            "max_queued_per_class": self.max_queued_per_class,
            "max_queued_per_tenant": self.max_queued_per_tenant,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.batch_max_wait < 0:
            raise ValueError(f"batch_max_wait must be >= 0, got {self.batch_max_wait}")

    def default_deadline(self, klass: Klass, arrival: float) -> float:
        """The absolute queue deadline of a request of `klass` that arrived at `arrival` and named none."""
        return arrival + (self.interactive_deadline if klass == "interactive" else self.batch_deadline)


class Ticket(msgspec.Struct, frozen=True, kw_only=True):
    """One request waiting for dispatch: who asked, in which class, until when, and how much work it is."""

    # Unique among queued and in-flight tickets.
    request_id: str
    tenant: str
    # The tenant's share weight (> 0): with weights 1 and 3 two backlogged tenants are served 1:3.
    tenant_weight: float = 1.0
    klass: Klass = "interactive"
    # Clock seconds when the request arrived (the queue-age guard measures batch waits from it).
    arrival: float
    # Absolute clock seconds: the latest time the ticket may still be dispatched.
    deadline: float
    prompt_tokens: int
    # The growth reserve: the most tokens the answer may generate.
    max_tokens: int

    @property
    def work(self) -> int:
        """Tokens of service this ticket may take (prompt plus the whole reserve), for wait predictions."""
        return self.prompt_tokens + self.max_tokens


class AdmissionError(Exception):
    """Base of every refusal by the admission queue."""

    status_code = 503
    code = "admission_refused"

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        # Seconds after which a retry may succeed (the HTTP layer rounds it up for `Retry-After`).
        self.retry_after = retry_after


class QueueFullError(AdmissionError):
    """A queue bound is reached; `reason` names it (`max_queued_per_class` or `max_queued_per_tenant`)."""

    code = "queue_full"

    def __init__(self, reason: str, retry_after: float) -> None:
        super().__init__(f"queue full: {reason} reached; retry in {retry_after:.3f} s", retry_after)
        self.reason = reason
        # The tenant's own backlog is its own load (429); a full class is the service's (503).
        self.status_code = 429 if reason == "max_queued_per_tenant" else 503


class DeadlineUnmeetableError(AdmissionError):
    """The predicted queue wait exceeds the time left to the ticket's deadline: refused rather than queued."""

    code = "deadline_unmeetable"

    def __init__(self, retry_after: float, predicted_wait: float) -> None:
        super().__init__(
            f"predicted queue wait {predicted_wait:.3f} s exceeds the deadline; retry in {retry_after:.3f} s",
            retry_after,
        )
        self.predicted_wait = predicted_wait
