"""Per-tenant token buckets on requests and tokens per second, checked when a request arrives
(before it queues): over a limit is a 429 naming it, with ``Retry-After`` the whole seconds until
the bucket holds enough. The clock is passed in."""

from __future__ import annotations

import math

from pdserve.router.errors import RouterError, bad_request
from pdserve.router.tenancy.tenant_config import TenantTable
from pdserve.router.tenancy.token_bucket import TokenBucket


class RateLimited(RouterError):
    """A 429 that carries the limit it hit (``requests_per_second`` or ``tokens_per_second``)."""


class TenantLimits:
    def __init__(self, table: TenantTable):
        self.table = table
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def _bucket(self, buckets: dict[str, TokenBucket], tenant: str, rate: float | None,
                capacity: float | None, now: float) -> TokenBucket | None:
        if rate is None:
            return None
        bucket = buckets.get(tenant)
        if bucket is None:
            bucket = buckets[tenant] = TokenBucket(rate, capacity, now)
        return bucket

    def check(self, tenant: str, tokens: int, now: float) -> None:
        """Take one request and ``tokens`` from the tenant's buckets, or raise: a 429 when they do
        not hold enough now, a 400 when the request is larger than the token bucket itself."""
        spec = self.table.spec(tenant)
        req = self._bucket(self._requests, tenant, spec.requests_per_second, spec.request_capacity, now)
        tok = self._bucket(self._tokens, tenant, spec.tokens_per_second, spec.token_capacity, now)
        if tok is not None and tokens > tok.capacity:
            raise bad_request(f"the request's {tokens} tokens (prompt + max tokens) exceed tenant "
                              f"{tenant!r}'s tokens_burst ({tok.capacity:g}): it can never be admitted",
                              "max_tokens")
        for bucket, amount, limit in ((req, 1, "requests_per_second"), (tok, tokens, "tokens_per_second")):
            if bucket is None:
                continue
            wait = bucket.wait_for(amount, now)
            if wait > 0:
                raise RateLimited(429, f"tenant {tenant!r} is over its {limit} limit "
                                  f"({getattr(spec, limit):g}); retry in {wait:.2f}s",
                                  "rate_limit_error", limit, max(1, math.ceil(wait)))
        for bucket, amount in ((req, 1), (tok, tokens)):
            if bucket is not None:
                bucket.take(amount, now)
