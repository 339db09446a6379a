"""What `lockgate bench` sends: arrivals, length distributions, cancellations, tenants and SLO targets.

A workload TOML decodes into `Workload`; every field has a default, so a file names only what it changes:

    requests = 200                  # or: duration = 60 (seconds of arrivals); not both
    prompt_tokens = {kind = "lognormal", median = 1500, sigma = 0.5, high = 6000}
    output_tokens = {kind = "uniform", low = 64, high = 512}
    cancel_fraction = 0.1           # these requests close their stream after `cancel_after` chunks
    cancel_after = {kind = "uniform", low = 1, high = 20}

    [arrival]
    process = "bursty"              # or "poisson"
    rate = 8.0                      # mean requests per second
    burst_size = 10                 # bursty: requests per burst
    burst_spread = 0.1              # bursty: seconds over which a burst's requests arrive

    [[tenants]]
    name = "chat"
    api_key = "lg-..."
    weight = 3                      # share of the traffic, relative to the other tenants
    priority = "interactive"        # sent as x-lockgate-priority

    [slo.interactive]
    ttft = 1.0                      # seconds to the first token
    itl = 0.1                       # mean seconds between tokens of the request

Errors name the field (`Expected `float`, got `str` - at `$.arrival.rate``).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from gateway.config import DEFAULT_MODEL_NAME

Priority = Literal["interactive", "batch"]
Positive = Annotated[float, msgspec.Meta(gt=0)]
Count = Annotated[int, msgspec.Meta(ge=1)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


class WorkloadError(ValueError):
    """A workload file or option that cannot be used; the message names the field."""


class _Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class Fixed(_Struct, tag="fixed", frozen=True, tag_field="kind"):
    """Always `value` tokens."""

    value: Count


class Uniform(_Struct, tag="uniform", frozen=True, tag_field="kind"):
    """Uniform over `low..high` tokens (both included)."""

    low: Count
    high: Count

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError("high must be >= low")


class LogNormal(_Struct, tag="lognormal", frozen=True, tag_field="kind"):
    """Log-normal with the given median and sigma (of the log), clipped to `low..high`: a long tail."""

    median: Positive
    sigma: Annotated[float, msgspec.Meta(ge=0)]
    low: Count = 1
    high: Count = 32768

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError("high must be >= low")


Length = Fixed | Uniform | LogNormal


class Arrival(_Struct, frozen=True):
    """The arrival process. Poisson: exponential gaps at `rate`. Bursty: bursts of `burst_size` requests
    spread evenly over `burst_spread` seconds, the bursts themselves Poisson at `rate / burst_size`, so the
    mean rate is `rate` either way."""

    process: Literal["poisson", "bursty"] = "poisson"
    rate: Positive = 10.0
    burst_size: Count = 10
    burst_spread: Annotated[float, msgspec.Meta(ge=0)] = 0.1


class Tenant(_Struct, frozen=True):
    """One tenant of the load: its key, its share of the traffic and the class its requests ask for."""

    name: str
    api_key: str
    weight: Positive = 1.0
    priority: Priority = "interactive"
    # Lengths of this tenant's requests when they differ from the workload's (e.g. a batch tenant with long
    # generations).
    prompt_tokens: Length | None = None
    output_tokens: Length | None = None


class Slo(_Struct, frozen=True):
    """A class's targets: a request meets them with TTFT <= `ttft` and mean inter-token gap <= `itl`."""

    ttft: Positive
    itl: Positive


def _default_slo() -> dict[Priority, Slo]:
    return {"interactive": Slo(ttft=1.0, itl=0.1), "batch": Slo(ttft=10.0, itl=0.5)}


class Workload(_Struct, frozen=True):
    """The whole load of one `lockgate bench` run."""

    model: str = DEFAULT_MODEL_NAME
    arrival: Arrival = Arrival()
    # How many requests, or for how many seconds requests arrive; with neither, 100 requests.
    requests: Count | None = None
    duration: Positive | None = None
    prompt_tokens: Length = Fixed(value=256)
    output_tokens: Length = Fixed(value=128)
    cancel_fraction: Fraction = 0.0
    cancel_after: Length = Uniform(low=1, high=16)  # content chunks received before the client closes
    tenants: tuple[Tenant, ...] = ()
    slo: dict[Priority, Slo] = msgspec.field(default_factory=_default_slo)
    seed: int = 0
    timeout: Positive = 300.0  # per request, seconds without progress before it counts as an error
    # Extra request fields for the target (e.g. `{ignore_eos = true}` for vLLM, so generations run to
    # max_tokens); the gateway itself refuses unknown fields.
    extra_body: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.requests is not None and self.duration is not None:
            raise ValueError("give requests or duration, not both")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")

    def limit(self) -> tuple[int | None, float | None]:
        """(request count, duration): the one given, or 100 requests."""
        if self.requests is None and self.duration is None:
            return 100, None
        return self.requests, self.duration

    def slo_of(self, priority: Priority) -> Slo:
        """The targets of a class (its defaults when the file does not name it)."""
        defaults = _default_slo()
        return self.slo.get(priority) or defaults[priority]


def load_workload(path: Path) -> Workload:
    """Read and check a workload TOML file."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise WorkloadError(f"{path}: {exc}") from exc
    return decode_workload(raw, source=str(path))


def decode_workload(raw: dict[str, Any], source: str = "workload") -> Workload:
    """A `Workload` from decoded TOML; errors name the field."""
    try:
        return msgspec.convert(raw, Workload)
    except msgspec.ValidationError as exc:
        raise WorkloadError(f"{source}: {exc}") from exc


def with_overrides(workload: Workload, **changes: Any) -> Workload:
    """`workload` with the fields given (not None) replaced, checked again as a whole."""
    given = {k: v for k, v in changes.items() if v is not None}
    if "requests" in given:
        given["duration"] = None
    elif "duration" in given:
        given["requests"] = None
    arrival = {k: given.pop(k) for k in ("rate", "process") if k in given}
    raw = msgspec.to_builtins(workload)
    raw.update(msgspec.to_builtins(given))
    raw["arrival"].update(arrival)
    return decode_workload(raw, source="options")
