"""Pairing: bootstrap fields, rooms, DP ranks, missing roles (pure logic)."""

import random

import msgspec
import pytest

from pdserve.router.config import WorkerSpec
from pdserve.router.errors import RouterError
from pdserve.router.workers.pairing import Pairing, prompt_text
from pdserve.router.simple_policies import RoundRobinPolicy
from pdserve.router.workers.worker_registry import WorkerRegistry


def make(dp_aware=False, prefill_dp=1, decode_dp=1, n=1):
    reg = WorkerRegistry(dp_aware)
    for i in range(n):
        p = reg.add(WorkerSpec(f"http://198.51.100.{10 + i}:30000", "prefill", 8998 + i), healthy=True)
        d = reg.add(WorkerSpec(f"http://198.51.100.{20 + i}:30001", "decode"), healthy=True)
        reg.set_server_info(p, prefill_dp)
        reg.set_server_info(d, decode_dp)
    return reg, Pairing(reg, RoundRobinPolicy(), RoundRobinPolicy(), random.Random(0))


def bodies(pairing, body):
    pair = pairing.choose(body)
    p, d = Pairing.leg_bodies(body, pair)
    return pair, msgspec.json.decode(p), msgspec.json.decode(d)


def test_bootstrap_fields_added_and_client_values_replaced():
    _, pairing = make()
    body = {"text": "hi", "model": "m", "bootstrap_room": 7, "bootstrap_host": "evil",
            "bootstrap_port": 1, "routed_dp_rank": 3, "sampling_params": {"max_new_tokens": 2}}
    pair, p, d = bodies(pairing, body)
    assert p == d  # without DP ranks both legs get the same body, as sglang-router sends
    assert p["bootstrap_host"] == "198.51.100.10"
    assert p["bootstrap_port"] == 8998
    assert p["bootstrap_room"] == pair.room != 7
    assert "routed_dp_rank" not in p
    assert p["model"] == "m" and p["sampling_params"] == {"max_new_tokens": 2}
    assert body["bootstrap_room"] == 7  # the client's dict is not modified


def test_rooms_are_63_bit_and_fresh():
    _, pairing = make()
    rooms = [pairing.choose({"text": "x"}).room for _ in range(2000)]
    assert len(set(rooms)) == 2000
    assert all(0 <= r < 2**63 for r in rooms)
    assert max(rooms) > 2**62  # uses the whole range


def test_batched_generate_gets_one_room_per_prompt():
    _, pairing = make()
    pair, p, _ = bodies(pairing, {"text": ["a", "b", "c"]})
    assert len(p["bootstrap_room"]) == 3 and len(set(p["bootstrap_room"])) == 3
    assert p["bootstrap_host"] == ["198.51.100.10"] * 3 and p["bootstrap_port"] == [8998] * 3


def test_no_bootstrap_port_is_sent_as_null():
    reg = WorkerRegistry()
    reg.add(WorkerSpec("http://[2001:db8::1]:30000", "prefill"), healthy=True)
    reg.add(WorkerSpec("http://198.51.100.2:30001", "decode"), healthy=True)
    pairing = Pairing(reg, RoundRobinPolicy(), RoundRobinPolicy())
    _, p, _ = bodies(pairing, {"text": "x"})
    assert p["bootstrap_port"] is None and p["bootstrap_host"] == "2001:db8::1"


def test_dp_ranks_from_server_info():
    # a worker reporting dp_size > 1 gets ranks even without --dp-aware
    _, pairing = make(prefill_dp=2, decode_dp=4)
    seen = set()
    for _ in range(8):
        pair, p, d = bodies(pairing, {"text": "x"})
        assert p["disagg_prefill_dp_rank"] == p["routed_dp_rank"] == pair.prefill.dp_rank
        assert d["routed_dp_rank"] == pair.decode.dp_rank
        assert d["disagg_prefill_dp_rank"] == pair.prefill.dp_rank  # decode must find the KV's rank
        assert p["bootstrap_room"] == d["bootstrap_room"]
        seen.add((pair.prefill.dp_rank, pair.decode.dp_rank))
    # round robin over (worker, rank) endpoints visits every rank
    assert {s[0] for s in seen} == {0, 1} and {s[1] for s in seen} == {0, 1, 2, 3}


def test_dp_aware_with_single_rank_workers_sends_rank_zero():
    _, pairing = make(dp_aware=True)
    _, p, d = bodies(pairing, {"text": "x"})
    assert p["routed_dp_rank"] == 0 and d["routed_dp_rank"] == 0


def test_power_of_two_counts_load_per_dp_rank():
    from pdserve.router.simple_policies import PowerOfTwoPolicy
    reg, _ = make(decode_dp=2)
    d0, d1 = reg.healthy_endpoints("decode")
    d0.load = 3
    pairing = Pairing(reg, RoundRobinPolicy(), PowerOfTwoPolicy(random.Random(0)))
    assert all(pairing.choose({"text": "x"}).decode is d1 for _ in range(20))


def test_missing_role_is_a_503_naming_it():
    reg = WorkerRegistry()
    reg.add(WorkerSpec("http://198.51.100.1:1", "prefill"), healthy=True)
    d = reg.add(WorkerSpec("http://198.51.100.2:1", "decode"), healthy=False)
    pairing = Pairing(reg, RoundRobinPolicy(), RoundRobinPolicy())
    with pytest.raises(RouterError) as e:
        pairing.choose({"text": "x"})
    assert e.value.status == 503 and "decode" in e.value.message
    reg.record_health(d, True, 3, 1)
    assert pairing.choose({"text": "x"}).decode.worker is d
    reg.remove("http://198.51.100.1:1")
    with pytest.raises(RouterError) as e:
        pairing.choose({"text": "x"})
    assert "prefill" in e.value.message


def test_exclude_avoids_failed_endpoints_while_others_remain():
    reg, pairing = make(n=3)
    bad = reg.healthy_endpoints("prefill")[0]
    for _ in range(10):
        assert pairing.choose({"text": "x"}, exclude={bad.key}).prefill is not bad
    everyone = {e.key for e in reg.healthy_endpoints("prefill")}
    assert pairing.choose({"text": "x"}, exclude=everyone).prefill.key in everyone


def test_health_thresholds():
    reg = WorkerRegistry()
    w = reg.add(WorkerSpec("http://198.51.100.1:1", "decode"), healthy=True)
    assert not reg.record_health(w, False, 2, 2)
    assert reg.record_health(w, False, 2, 2) and not w.healthy
    assert reg.healthy_endpoints("decode") == []
    assert not reg.record_health(w, True, 2, 2)
    assert reg.record_health(w, True, 2, 2) and w.healthy
    assert len(reg.healthy_endpoints("decode")) == 1


def test_prompt_text_for_each_api():
    assert prompt_text({"text": "abc"}) == "abc"
    assert prompt_text({"prompt": ["p1", "p2"]}) == "p1"
    assert prompt_text({"messages": [{"role": "system", "content": "s"},
                                     {"role": "user", "content": [{"type": "text", "text": "u"}]}]}) == "s\nu"
    assert prompt_text({"input_ids": [1, 2, 3]}) == "1 2 3"
