"""Speculation on the decode side of PD: the real prefill and decode loops over the ``local`` transfer
backend (``tests/loop_stand.py``), the KV sent chunk by chunk or layer by layer, drafts verified on
the decode rank only. The first token comes from the prefill; every later token equals plain
decoding's, streamed or not, and both pools are unleaked after every step."""

from __future__ import annotations

import pytest

from support.loop_stand import PDPair, reference
from oracle import FREE_RULE, OracleProposer


@pytest.fixture(params=[False, True], ids=["chunk-level", "layer-wise"])
def pair(request):
    """The KV sent chunk by chunk, or layer by layer while the prefill computes (``layerwise``)."""
    p = PDPair(d_engine=dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4), layerwise=request.param)
    yield p
    p.close()


def test_decode_side_verifies_drafts_and_outputs_equal_plain_decoding(pair):
    prompts = {f"r{i}": [7 + i, 3, 9 + 2 * i, 4, 1, 8] * (1 + i % 2) for i in range(4)}
    max_new = 17
    assert pair.prefill.spec is None  # the prefill side never speculates
    oracle = OracleProposer({rid: p + reference(p, max_new) for rid, p in prompts.items()})
    pair.decode.spec.proposer = oracle
    pair.decode.spec.rule = FREE_RULE()  # every draft verified: the verify step is what is checked
    for i, (rid, p) in enumerate(prompts.items()):
        pair.submit(rid, p, max_new=max_new, stream=i % 2 == 0)
    pair.run(pair.done(*prompts, sides="D"), timeout=30)
    pair.settle()
    for rid, p in prompts.items():
        assert pair.tokens(rid) == reference(p, max_new), rid
        final = pair.final("D", rid)
        assert final.spec_verify_ct > 0 and final.spec_accept_token_num > 0
    stats = pair.decode.spec.stats
    assert stats.accepted > 0 and stats.proposed > stats.accepted  # runs accepted and rejected
    assert oracle.released == set(prompts)
    # the rank's /metrics families carry the counters
    fams = {f.name: f for f in pair.decode.rank_metrics().families}
    assert fams["pdserve_spec_accepted_tokens"].samples[0].value == stats.accepted > 0
    assert fams["pdserve_spec_accept_length"].samples[-1].name == "pdserve_spec_accept_length_sum"
