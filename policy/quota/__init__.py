"""Token-bucket quotas: the `QuotaStore` protocol and its in-process and Redis backends."""

from policy.quota.base import (
    BucketSpec,
    QuotaBackendError,
    QuotaBusyError,
    QuotaError,
    QuotaExceededError,
    QuotaImpossibleError,
    QuotaStore,
    Reservation,
    ReservationClosedError,
)
from policy.quota.lease import LeasedQuotaStore, LeasePolicy
from policy.quota.memory import MemoryQuotaStore
from policy.quota.redis import RedisQuotaStore
from policy.quota.settle import SettlePolicy, Settler

__all__ = [
    "BucketSpec",
    "LeasePolicy",
    "LeasedQuotaStore",
    "MemoryQuotaStore",
    "QuotaBackendError",
    "QuotaBusyError",
    "QuotaError",
    "QuotaExceededError",
    "QuotaImpossibleError",
    "QuotaStore",
    "RedisQuotaStore",
    "Reservation",
    "ReservationClosedError",
    "SettlePolicy",
    "Settler",
]
