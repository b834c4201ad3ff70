"""kv_aware's pure parts: the index's prefix overlap, sequence checks, the cost, and prompts
tokenized exactly as the server tokenizes them."""

from __future__ import annotations

import pytest

from pdserve.engine.mem_cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, block_hashes
from pdserve.router.config import RouterConfig
from pdserve.router.kv.kv_aware_policy import choose_by_overlap, kv_cost, prompt_ids
from pdserve.router.kv.kv_index import KVIndex, SeqAction, SeqTracker
from pdserve.router.policy import POLICY_NAMES, policy_class


class E:
    def __init__(self, key: str, load: int = 0):
        self.key, self.load = key, load


def stored(hashes, parent=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[0] * len(hashes),
                       block_size=1, lora_id=None, medium="GPU")


def test_index_overlap_is_a_prefix_match_and_clear_forgets():
    idx = KVIndex()
    h = block_hashes(list(range(8)), 2)  # 4 chained blocks
    idx.apply("a", [stored(h)])
    idx.apply("b", [stored(h[:2])])
    idx.apply("c", [stored(h[1:])])  # holds later blocks without the first: of no use
    assert idx.overlap(h, ["a", "b", "c", "d"]) == {"a": 4, "b": 2, "c": 0, "d": 0}
    idx.apply("a", [BlockRemoved(block_hashes=[h[2]], medium="GPU")])
    assert idx.overlap(h, ["a", "b"]) == {"a": 2, "b": 2}
    idx.apply("b", [AllBlocksCleared(), stored([h[0]])])
    assert idx.overlap(h, ["b"]) == {"b": 1} and idx.num_blocks("b") == 1
    idx.clear("a")
    assert idx.holders(h[0]) == {"b"} and idx.num_blocks("a") == 0 and sorted(idx.keys()) == ["b", "c"]
    idx.apply("b", [BlockRemoved(block_hashes=[12345], medium=None)])  # unknown: ignored


def test_seq_tracker_actions():
    t = SeqTracker()
    assert t.check(0) is SeqAction.APPLY
    t.applied(0)
    assert t.check(1) is SeqAction.APPLY and t.check(3) is SeqAction.GAP and t.expected == 1
    t.applied(3)
    assert t.check(2) is SeqAction.STALE and t.check(3) is SeqAction.STALE
    assert t.check(0) is SeqAction.RESTART
    assert SeqTracker().check(5) is SeqAction.GAP  # joined late: ask for 0..4


def test_cost_prefers_the_holder_until_its_queue_costs_more():
    eps = [E("a"), E("b")]
    # a holds 8 of 10 blocks
    assert choose_by_overlap(eps, {"a": 8}, 10, 4.0, 1.0, {}).key == "a"
    # 3 requests of ~4 uncached blocks queued on a (cost 2 + 12) outweigh b's 10 uncached blocks
    eps[0].load = 3
    assert kv_cost(2, 3, 4.0, 1.0) == 14.0
    assert choose_by_overlap(eps, {"a": 8}, 10, 4.0, 1.0, {}).key == "b"
    # a heavier overlap weight makes the cache matter more than the queue
    assert choose_by_overlap(eps, {"a": 8}, 10, 4.0, 2.0, {}).key == "a"
    # ties: less load, then fewer cached blocks (room for a new prefix group)
    eps[0].load = 0
    assert choose_by_overlap(eps, {}, 10, 4.0, 1.0, {"a": 30, "b": 5}).key == "b"


def test_kv_aware_is_registered_with_its_flags():
    assert "kv_aware" in POLICY_NAMES
    assert policy_class("kv_aware").__name__ == "KVAwarePolicy"
    with pytest.raises(ValueError):
        RouterConfig(kv_overlap_score_weight=-1)
    from pdserve.router.cli import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(
        ["--prefill-policy", "kv_aware", "--kv-overlap-score-weight", "2", "--kv-events-timeout-secs", "5"]))
    assert cfg.kv_overlap_score_weight == 2.0 and cfg.kv_events_timeout_secs == 5.0


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.engine.text.tokenizer import load_tokenizer

    return load_tokenizer(None)


def test_prompt_ids_match_the_servers_tokenization(tokenizer):
    from pdserve.engine.text.prompt import ChatPrompt, encode_prompt

    body = {"messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}
    want = encode_prompt(tokenizer, ChatPrompt([{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Hi there"}]))
    assert prompt_ids(tokenizer, body) == want
    assert prompt_ids(tokenizer, {"prompt": "Once upon"}) == encode_prompt(tokenizer, "Once upon")
    assert prompt_ids(tokenizer, {"text": "Once upon"}) == encode_prompt(tokenizer, "Once upon")
    assert prompt_ids(tokenizer, {"input_ids": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_ids(tokenizer, {"text": ["a", "b"]}) is None  # a batch: the fallback routes it


def test_predicted_blocks_count_until_their_deadline_or_a_clear():
    idx = KVIndex()
    h = block_hashes(list(range(6)), 2)
    idx.predict("a", h, until=10.0)
    assert idx.overlap(h, ["a", "b"], now=5.0) == {"a": 3, "b": 0}
    assert idx.overlap(h, ["a"], now=11.0) == {"a": 0}  # expired
    idx.apply("a", [stored(h[:1])])  # the real event confirms the first block; the rest still predicted
    assert idx.overlap(h, ["a"], now=5.0) == {"a": 3} and idx.overlap(h, ["a"], now=11.0) == {"a": 1}
    idx.apply("a", [BlockRemoved(block_hashes=[h[1]], medium="GPU")])
    assert idx.overlap(h, ["a"], now=5.0) == {"a": 1}
    idx.predict("a", h, until=10.0)
    idx.apply("a", [AllBlocksCleared()])
    assert idx.overlap(h, ["a"], now=5.0) == {"a": 0}


def test_policy_counts_reach_the_router_metrics():
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.policy import Policy
    from pdserve.router.workers.worker_registry import WorkerRegistry

    class Counting(Policy):
        def select(self, endpoints, text):
            return endpoints[0]

        def counts(self):
            return {"gaps": 2, "malformed": 1}

    text = RouterMetrics(WorkerRegistry(), {"prefill": Counting()}).render().decode()
    assert 'pdserve_router_policy_events_total{role="prefill",event="gaps"} 2.0' in text
    assert 'pdserve_router_policy_events_total{role="prefill",event="malformed"} 1.0' in text
