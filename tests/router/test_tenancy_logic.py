"""The tenancy layer's pure parts with the clock injected: token buckets, deficit round-robin
between tenants (priority inside one), the prefill-rate estimator, request costs, the config."""

from __future__ import annotations

import pytest

from pdserve.router.errors import RouterError
from pdserve.router.tenancy.drr import DeficitRoundRobin
from pdserve.router.tenancy.request_cost import request_cost
from pdserve.router.tenancy.tenant_config import parse_tenant_table
from pdserve.router.tenancy.tenant_limits import TenantLimits
from pdserve.router.tenancy.token_bucket import TokenBucket
from pdserve.router.tenancy.ttft_estimator import PrefillRateEstimator


def test_bucket_refills_at_its_rate_and_says_how_long_to_wait():
    b = TokenBucket(rate=2.0, capacity=4.0, now=0.0)
    b.take(4, 0.0)
    assert b.wait_for(1, 0.0) == 0.5
    assert b.wait_for(1, 0.5) == 0.0
    assert b.wait_for(10, 100.0) == 3.0  # capped at capacity 4


def test_limits_answer_429_with_retry_after_and_400_past_the_burst():
    limits = TenantLimits(parse_tenant_table({"tenants": {"a": {"requests_per_second": 1,
                                                                 "tokens_per_second": 100}}}))
    limits.check("a", 10, 0.0)
    with pytest.raises(RouterError) as e:
        limits.check("a", 10, 0.1)
    assert e.value.status == 429 and e.value.param == "requests_per_second" and e.value.retry_after == 1
    with pytest.raises(RouterError) as e:
        limits.check("a", 1000, 5.0)
    assert e.value.status == 400
    limits.check("other", 10**6, 0.0)  # the default tenant has no limits


def test_drr_shares_tokens_by_weight_and_a_flood_does_not_starve_a_quiet_tenant():
    drr = DeficitRoundRobin(quantum=100)
    for i in range(50):
        drr.push("flood", 1, 0, 100, f"f{i}")
    drr.push("quiet", 1, 0, 100, "q0")
    order = [drr.pop(lambda n: True, lambda x: True)[1] for _ in range(3)]
    assert "q0" in order[:2]
    drr2 = DeficitRoundRobin(quantum=100)
    for i in range(40):
        drr2.push("a", 3, 0, 100, "a")
        drr2.push("b", 1, 0, 100, "b")
    served = [drr2.pop(lambda n: True, lambda x: True)[1] for _ in range(40)]
    assert served.count("a") == 30 and served.count("b") == 10


def test_drr_orders_by_priority_inside_a_tenant_and_skips_capped_ones():
    drr = DeficitRoundRobin(quantum=10)
    drr.push("a", 1, 5, 1, "low")
    drr.push("a", 1, -9, 1, "high")
    drr.push("b", 1, 0, 1, "b")
    assert drr.pop(lambda n: n == "a", lambda x: True) == ("a", "high")
    assert drr.pop(lambda n: n == "b", lambda x: True) == ("b", "b")
    assert drr.pop(lambda n: n == "b", lambda x: True) is None
    assert drr.pop(lambda n: True, lambda x: x != "low") is None


def test_estimator_learns_the_rate_from_first_bytes():
    est = PrefillRateEstimator()
    assert est.estimate_s(0, 100) is None
    t = est.admitted(1000, now=0.0)
    est.first_byte(t, now=0.5)
    assert est.rate == 2000.0 and est.prefilling == 0
    assert est.estimate_s(1000, 1000) == 1.0


def test_cost_and_config():
    assert request_cost({"text": "abcdefgh", "sampling_params": {"max_new_tokens": 3}}).tokens == 5
    assert request_cost({"messages": [{"role": "user", "content": "abcd"}]}).max_new_tokens == 128
    with pytest.raises(ValueError, match="tenants.x: weight"):
        parse_tenant_table({"tenants": {"x": {"weight": 0}}})


def test_drr_with_a_quantum_far_below_the_cost_alternates_by_weight():
    drr = DeficitRoundRobin(quantum=1)  # 100_000 rounds a request: skipped, not walked
    for tenant, weight in (("a", 3), ("b", 1)):
        for _ in range(8):
            drr.push(tenant, weight, 0, 100_000, tenant)
    order = []
    while (popped := drr.pop(lambda _: True, lambda _: True)) is not None:
        order.append(popped[1])
    assert "".join(order) == "aaab" * 2 + "aab" + "bbbbb"
