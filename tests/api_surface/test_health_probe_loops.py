"""/health_generate's probe inside the PD loops: it carries no bootstrap fields and runs on the rank
itself, without a KV peer (SGLang's fake bootstrap): the prefill loop computes the KV and drops it,
the decode loop prefills the prompt locally even without ``max_local_prefill_tokens``. Both pools are
checked after every step, and every page is back at the end."""

from __future__ import annotations

import pytest
from support.loop_stand import PDPair, reference

from pdserve.engine.messages import TokenizedGenerateReq
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)


def probe(rid: str, health_probe: bool = True) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid, [5, 6, 7, 8, 9], SamplingParams(max_new_tokens=1, temperature=0.0),
                                health_probe=health_probe)


@pytest.fixture
def pair():
    p = PDPair()
    yield p
    p.close()


def test_the_probe_runs_on_both_sides_without_a_peer(pair):
    pair.prefill.add_request(probe("hp"))
    pair.decode.add_request(probe("hd"))
    pair.submit("r", [3] * 9, max_new=3)  # an ordinary PD request beside the probes
    pair.run(lambda: pair.final("P", "hp") is not None and pair.final("D", "hd") is not None
             and pair.final("D", "r") is not None)
    for side, rid in (("P", "hp"), ("D", "hd")):
        out = pair.final(side, rid)
        assert out.finish_reason == "length" and out.error is None, out
        assert out.new_token_ids == reference([5, 6, 7, 8, 9], 1)
    assert pair.tokens("r") == reference([3] * 9, 3)
    pair.settle()


def test_without_the_probe_flag_both_sides_still_need_a_peer(pair):
    pair.prefill.add_request(probe("p", health_probe=False))
    pair.decode.add_request(probe("d", health_probe=False))
    pair.run(pair.done("p", sides="P"))
    pair.run(pair.done("d", sides="D"))
    assert "needs bootstrap_host" in pair.final("P", "p").error
    assert "needs bootstrap_host" in pair.final("D", "d").error
    pair.settle()
