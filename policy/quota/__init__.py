"""Token-bucket quotas: the `QuotaStore` protocol and its in-process and Redis backends."""

from policy.quota.base import (
    BucketSpec,
    QuotaBackendError,
    QuotaError,
    QuotaExceededError,
    QuotaImpossibleError,
    QuotaStore,
    Reservation,
)
from policy.quota.memory import MemoryQuotaStore
from policy.quota.redis import RedisQuotaStore

__all__ = [
    "BucketSpec",
    "MemoryQuotaStore",
    "QuotaBackendError",
    "QuotaError",
    "QuotaExceededError",
    "QuotaImpossibleError",
    "QuotaStore",
    "RedisQuotaStore",
    "Reservation",
]
