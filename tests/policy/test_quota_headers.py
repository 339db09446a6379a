"""The quota headers every metered answer carries: the IETF draft's `RateLimit`, and OpenAI's `x-ratelimit-*`
(per kind, from the tightest of the tenant's and the key's buckets)."""

from __future__ import annotations

import pytest

from policy.quota.meter import BucketSet, bucket_set, go_duration, rate_limit_headers
from policy.tenants.models import ApiKey, Limits, Quotas, Tenant

TENANT = Limits(requests_per_second=10, request_burst=20, tokens_per_second=100, token_burst=1000)
PER_KEY = Limits(requests_per_second=1, request_burst=5, tokens_per_second=50, token_burst=5000)
KEY = ApiKey(key_id="k1", tenant_id="acme", roles=("consumer",), created_at=0.0)


def buckets(quotas: Quotas) -> BucketSet:
    return bucket_set(Tenant(tenant_id="acme", display_name="Acme", quotas=quotas), KEY)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.0001, "1ms"),
        (0.02, "20ms"),
        (0.9991, "1s"),
        (1.5, "1.5s"),
        (7.66, "7.66s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (3723.5, "1h2m3.5s"),
    ],
)
def test_durations_are_printed_as_go_prints_them(seconds: float, text: str) -> None:
    assert go_duration(seconds) == text


def test_openai_headers_come_from_the_tightest_bucket_of_each_kind() -> None:
    spec = buckets(Quotas(tenant=TENANT, per_key=PER_KEY))
    assert spec.names == ("tenant-requests", "tenant-tokens", "key-requests", "key-tokens")
    # Requests: the key's bucket holds less (3 of 5, refilling at 1/s); tokens: the tenant's (400 of 1000, at
    # 100/s), though the key's capacity is larger.
    headers = rate_limit_headers(spec, (12.0, 400.0, 3.0, 4500.0))
    assert headers["x-ratelimit-limit-requests"] == "5"
    assert headers["x-ratelimit-remaining-requests"] == "3"
    assert headers["x-ratelimit-reset-requests"] == "2s"
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "400"
    assert headers["x-ratelimit-reset-tokens"] == "6s"
    # The draft's headers still name every bucket.
    assert headers["RateLimit"].split(", ") == [
        '"tenant-requests";r=12;t=1',
        '"tenant-tokens";r=400;t=6',
        '"key-requests";r=3;t=2',
        '"key-tokens";r=4500;t=10',
    ]


def test_a_bucket_in_debt_reports_nothing_left_and_the_time_to_refill_all_of_it() -> None:
    spec = buckets(Quotas(tenant=TENANT))
    headers = rate_limit_headers(spec, (20.0, -50.0))  # a stream that used more than it reserved
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == "10.5s"
    assert headers["x-ratelimit-remaining-requests"] == "20"
    assert headers["x-ratelimit-reset-requests"] == "0s"


def test_an_unmetered_key_gets_no_quota_headers() -> None:
    assert rate_limit_headers(buckets(Quotas()), ()) == {}
