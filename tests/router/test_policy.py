"""Policies: distribution, load balance, prefix affinity (pure logic, no sockets)."""

import random
from collections import Counter

import pytest

from pdserve.router.kv.cache_aware_policy import CacheAwarePolicy
from pdserve.router.cli import build_parser
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.policy import POLICIES, Policy, make_policy, policy_class
from pdserve.router.simple_policies import PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy
from pdserve.router.workers.worker_registry import Endpoint, Worker


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(Worker(WorkerSpec(f"http://10.0.0.{i}:8000", "prefill")), None) for i in range(n)]


def test_registry_names_are_the_cli_choices():
    choices = {a.dest: a.choices for a in build_parser()._actions}
    for flag in ("policy", "prefill_policy", "decode_policy"):
        assert set(POLICIES) == set(choices[flag]), flag
    for name in POLICIES:
        assert issubclass(policy_class(name), Policy)
        assert isinstance(make_policy(name, RouterConfig()), policy_class(name))
    with pytest.raises(ValueError, match="'fastest'.*round_robin"):
        make_policy("fastest", RouterConfig())
    with pytest.raises(ValueError, match="prefill_policy must be one of"):
        RouterConfig(prefill_policy="fastest")


def test_cache_aware_knobs_come_from_the_config():
    policy = make_policy("cache_aware", RouterConfig(cache_threshold=0.7, balance_abs_threshold=3,
                                                     balance_rel_threshold=2.0, max_tree_size=99))
    assert (policy.cache_threshold, policy.abs_threshold, policy.rel_threshold) == (0.7, 3, 2.0)
    assert policy.tree.max_size == 99


def test_random_spreads_evenly():
    eps = endpoints(4)
    policy = RandomPolicy(random.Random(1))
    counts = Counter(policy.select(eps, None).key for _ in range(4000))
    assert len(counts) == 4
    assert all(800 <= c <= 1200 for c in counts.values()), counts


def test_round_robin_cycles_in_order_and_survives_a_shrinking_list():
    eps = endpoints(3)
    policy = RoundRobinPolicy()
    assert [policy.select(eps, None) for _ in range(6)] == eps + eps
    assert policy.select(eps[:2], None) in eps[:2]


def test_power_of_two_prefers_the_less_loaded():
    eps = endpoints(2)
    eps[0].load, eps[1].load = 5, 1
    policy = PowerOfTwoPolicy(random.Random(0))
    assert all(policy.select(eps, None) is eps[1] for _ in range(50))


def test_power_of_two_keeps_load_balanced_while_requests_pile_up():
    eps = endpoints(8)
    policy = PowerOfTwoPolicy(random.Random(2))
    rng = random.Random(3)
    for _ in range(2000):
        policy.select(eps, None).load += 1
        if rng.random() < 0.5:  # some finish, picked at random
            busy = [e for e in eps if e.load]
            rng.choice(busy).load -= 1
    loads = [e.load for e in eps]
    assert max(loads) - min(loads) <= 0.25 * max(loads) + 4, loads


def test_cache_aware_routes_a_shared_prefix_to_the_same_worker():
    eps = endpoints(4)
    policy = CacheAwarePolicy(cache_threshold=0.3)
    first = {}
    for i in range(8):
        system = f"system prompt number {i}: " + "x" * 200
        first[i] = policy.select(eps, system + "question 0")
    # different prefixes spread out (smallest tree wins when nothing matches)
    assert len({e.key for e in first.values()}) == 4
    for i in range(8):
        system = f"system prompt number {i}: " + "x" * 200
        for q in range(1, 5):
            assert policy.select(eps, system + f"question {q}") is first[i]
    policy.tree.check_integrity()


def test_cache_aware_goes_to_the_least_loaded_when_imbalanced():
    eps = endpoints(3)
    policy = CacheAwarePolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    prompt = "a long shared prefix " * 10
    owner = policy.select(eps, prompt)
    others = [e for e in eps if e is not owner]
    owner.load, others[0].load, others[1].load = 4, 3, 1
    # within the thresholds (4 - 1 <= 4) the prefix match wins over the lighter load
    assert policy.select(eps, prompt) is owner
    # 10 - 1 > 4 and 10 > 1.5 * 1: imbalanced, so the match is ignored for the least loaded
    owner.load = 10
    assert policy.select(eps, prompt) is others[1]


def test_cache_aware_tree_is_bounded_and_forgets_removed_workers():
    eps = endpoints(2)
    policy = CacheAwarePolicy(max_tree_size=500)
    rng = random.Random(0)
    for _ in range(300):
        policy.select(eps, "".join(rng.choice("abcd") for _ in range(rng.randrange(5, 60))))
        assert all(size <= 500 for size in policy.tree.sizes.values())
    policy.tree.check_integrity()
    policy.forget(eps[0].key)
    assert eps[0].key not in policy.tree.sizes
    policy.tree.check_integrity()
    _, tenant = policy.tree.match("abcd" * 10, {eps[0].key})
    assert tenant is None
