"""The DP-rank rule (pure logic): fewest tokens in flight, ties in turn, round robin, a client's
named rank, the token estimate, and the flag."""

import random

import pytest

from pdserve.router.cli import build_parser, config_from_args
from pdserve.router.config import RouterConfig, WorkerSpec
from pdserve.router.errors import RouterError
from pdserve.router.policy import Policy
from pdserve.router.simple_policies import RoundRobinPolicy
from pdserve.router.workers.dp_rank_choice import DpRankChoice
from pdserve.router.workers.pairing import Pairing
from pdserve.router.workers.request_tokens import DEFAULT_MAX_NEW_TOKENS, request_tokens
from pdserve.router.workers.worker_registry import WorkerRegistry


def make(rule="least_tokens", prefill_dp=2, decode_dp=2, n_decode=1, decode_policy=None):
    reg = WorkerRegistry()
    p = reg.add(WorkerSpec("http://198.51.100.10:30000", "prefill", 8998), healthy=True)
    reg.set_server_info(p, prefill_dp)
    for i in range(n_decode):
        d = reg.add(WorkerSpec(f"http://198.51.100.{20 + i}:30001", "decode"), healthy=True)
        reg.set_server_info(d, decode_dp)
    pairing = Pairing(reg, RoundRobinPolicy(), decode_policy or RoundRobinPolicy(), random.Random(0),
                      dp_ranks=DpRankChoice(rule))
    return reg, pairing


def dispatch(pairing, body):
    """Choose a pair and count the request on it, as the proxy does while its legs run."""
    pair = pairing.choose(body)
    cost = request_tokens(body)
    pair.decode.begin(cost.decode)
    return pair, cost


def test_least_tokens_takes_the_rank_with_fewest_tokens_not_fewest_requests():
    reg, pairing = make()
    d0, d1 = reg.healthy_endpoints("decode")
    long = {"input_ids": list(range(1000)), "sampling_params": {"max_new_tokens": 500}}
    short = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}}
    assert dispatch(pairing, long)[0].decode is d0
    for _ in range(5):  # five short requests all go beside the long one: fewer tokens, more requests
        assert dispatch(pairing, short)[0].decode is d1
    assert (d0.load, d1.load) == (1, 5) and (d0.tokens, d1.tokens) == (1500, 40)


def test_ties_take_turns_and_round_robin_ignores_load():
    reg, pairing = make()
    assert [pairing.choose({"text": "x"}).decode.dp_rank for _ in range(4)] == [0, 1, 0, 1]
    reg, pairing = make("round_robin", decode_dp=3)
    d0 = reg.healthy_endpoints("decode")[0]
    d0.begin(10_000)
    assert [pairing.choose({"text": "x"}).decode.dp_rank for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_each_worker_offers_one_rank_and_the_policy_picks_the_worker():
    reg, pairing = make(n_decode=2)
    a0, a1, b0, b1 = reg.healthy_endpoints("decode")
    a0.begin(100)
    b1.begin(50)
    seen = [pairing.choose({"text": "x"}).decode for _ in range(2)]
    assert seen == [a1, b0]  # round robin over the two workers, each at its least-loaded rank


def test_a_client_named_rank_keeps_winning():
    reg, pairing = make()
    d0, d1 = reg.healthy_endpoints("decode")
    d1.begin(10_000)  # the busy rank
    for field in ("routed_dp_rank", "data_parallel_rank"):
        pair = pairing.choose({"text": "x", field: 1, "disagg_prefill_dp_rank": 0})
        assert pair.decode is d1 and pair.prefill.dp_rank == 0
        p, d = Pairing.leg_bodies({"text": "x", field: 1, "disagg_prefill_dp_rank": 0}, pair)
        assert b'"routed_dp_rank":1' in d and b'"disagg_prefill_dp_rank":0' in d
        assert b'"data_parallel_rank"' not in p + d  # one rank field per leg: the router's
    assert pairing.choose({"text": "x", "disagg_prefill_dp_rank": 1}).prefill.dp_rank == 1


@pytest.mark.parametrize("field, value, words", [
    ("routed_dp_rank", 2, "routed_dp_rank 2 is not a DP rank of any healthy decode worker (ranks 0..1)"),
    ("disagg_prefill_dp_rank", 5, "disagg_prefill_dp_rank 5 is not a DP rank of any healthy prefill worker"),
    ("routed_dp_rank", -1, "routed_dp_rank must be a DP rank (an integer >= 0), got -1"),
    ("data_parallel_rank", "1", "data_parallel_rank must be a DP rank"),
    ("routed_dp_rank", True, "routed_dp_rank must be a DP rank"),
])
def test_a_bad_named_rank_is_a_400_naming_the_field(field, value, words):
    _, pairing = make()
    with pytest.raises(RouterError) as e:
        pairing.choose({"text": "x", field: value})
    assert e.value.status == 400 and e.value.param == field and words in e.value.message


def test_a_failed_named_rank_is_retried_on_that_rank():
    reg, pairing = make(n_decode=2)
    a0, a1, b0, b1 = reg.healthy_endpoints("decode")
    assert pairing.choose({"text": "x", "routed_dp_rank": 1}, exclude={a1.key}).decode is b1
    assert pairing.choose({"text": "x", "routed_dp_rank": 1}, exclude={a1.key, b1.key}).decode.dp_rank == 1


def test_a_policy_that_scores_ranks_sees_them_all():
    class Scores(Policy):
        scores_dp_ranks = True

        def select(self, endpoints, text):
            self.seen = [e.key for e in endpoints]
            return endpoints[-1]

    policy = Scores()
    reg, pairing = make(decode_dp=4, decode_policy=policy)
    assert pairing.choose({"text": "x"}).decode.dp_rank == 3 and len(policy.seen) == 4


def test_request_tokens():
    assert request_tokens({"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 7}}) == (10, 17)
    assert request_tokens({"text": "a" * 40}) == (10, 10 + DEFAULT_MAX_NEW_TOKENS)
    assert request_tokens({"text": "abc", "max_tokens": 4}, prompt_tokens=3) == (3, 7)  # tokenized: exact
    assert request_tokens({"messages": [{"role": "user", "content": "b" * 8}], "max_completion_tokens": 2,
                           "n": 3}) == (2, 2 + 6)
    assert request_tokens({"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 1}}) == (5, 7)
    assert request_tokens({"prompt": [5, 6, 7], "max_tokens": 0}) == (3, 3)


def test_the_flag():
    assert RouterConfig().dp_rank_policy == "least_tokens"
    parse = build_parser().parse_args
    assert config_from_args(parse(["--dp-rank-policy", "round_robin"])).dp_rank_policy == "round_robin"
    assert config_from_args(parse(["--dp-minimum-tokens-scheduler"])).dp_rank_policy == "least_tokens"
    with pytest.raises(ValueError, match="contradicts --dp-rank-policy round_robin"):
        config_from_args(parse(["--dp-minimum-tokens-scheduler", "--dp-rank-policy", "round_robin"]))
    with pytest.raises(ValueError, match="dp_rank_policy must be one of"):
        RouterConfig(dp_rank_policy="fewest")
