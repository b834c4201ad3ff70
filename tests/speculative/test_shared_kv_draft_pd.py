"""The STANDALONE self-draft on the decode side of PD: the real prefill and decode loops over the
``local`` transfer backend (``tests/loop_stand.py``), with a tiny real checkpoint in both instead of
the echo model. The decode's w8a16 self-draft drafts over the prompt KV the prefill sent (no
catch-up, no pool of its own); greedy outputs equal plain decoding's and both pools end unleaked."""

from __future__ import annotations

import pytest
import torch
from support.model_util import greedy_generate, make_tiny_checkpoint, random_prompts

from support import loop_stand
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.speculative.adaptive import AdaptiveRule

torch.set_num_threads(1)


@pytest.fixture
def pair(tmp_path, monkeypatch):
    make_tiny_checkpoint("llama", str(tmp_path))
    model = dict(model_path=str(tmp_path), dtype="float32", max_total_tokens=256)
    monkeypatch.setattr(loop_stand, "EchoRunner", lambda num_pages, config: ModelRunner(config))
    p = loop_stand.PDPair(p_engine=model, d_engine=dict(model, speculative_algorithm="STANDALONE",
                                                        speculative_num_draft_tokens=3,
                                                        speculative_draft_quantization="w8a16"))
    yield p, str(tmp_path)
    p.close()


def test_decode_side_self_draft_over_the_sent_kv_equals_plain_decoding(pair):
    pair, path = pair
    spec = pair.decode.spec
    assert spec.shares_kv and spec.proposer.runner.page_pool is pair.decode.runner.page_pool
    spec.draft_cost = 0.0
    spec.rule = AdaptiveRule(3)  # priced free: the tiny draft's step is all Python overhead
    prompts = dict(zip(["a", "b", "c"], random_prompts([6, 11, 3], seed=4)))
    max_new = 12
    plain = ModelRunner(EngineConfig(model_path=path, dtype="float32", max_total_tokens=256, page_size=loop_stand.PS))
    want, _ = greedy_generate(plain, list(prompts.values()), max_new)
    for rid, p in prompts.items():
        pair.submit(rid, p, max_new=max_new)
    pair.run(pair.done(*prompts, sides="D"), timeout=60)
    pair.settle()
    assert [pair.tokens(rid) for rid in prompts] == want
    assert spec.stats.verify_steps > 0 and spec.stats.accepted > 0
