"""1P1D over NIXL (UCX): greedy outputs equal the colocated server's, chunked prompts and logprobs included."""

from __future__ import annotations

import pytest
from support.pd_stand import Server, greedy_body, pd_post, prompt_ids

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def pair(request):
    P = Server("PN", "prefill", "--max-total-tokens", "2048", backend="nixl")
    D = Server("DN", "decode", "--max-total-tokens", "2048", backend="nixl")
    try:
        request.getfixturevalue("colocated")
        yield P.wait_ready(), D.wait_ready()
    finally:
        P.stop()
        D.stop()


def test_1p1d_nixl_greedy_equals_colocated(pair, reference):
    P, D = pair
    for n in (1, 64, 150):
        ids = prompt_ids(n, seed=1000 + n)
        p, d = pd_post(P, D, "/generate", greedy_body(ids, 6))
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        assert p.json()["output_ids"] == reference(ids, 6)[:1]
        assert d.json()["output_ids"] == reference(ids, 6)
    P.wait_unleaked()
    D.wait_unleaked()


def test_first_token_logprobs_cross_in_the_aux_data(pair, colocated):
    P, D = pair
    body = dict(greedy_body(prompt_ids(20, seed=5), 3), return_logprob=True, top_logprobs_num=3)
    want = colocated.post("/generate", body).json()["meta_info"]
    p, d = pd_post(P, D, "/generate", body)
    got = d.json()["meta_info"]
    assert d.status_code == 200, d.text
    # [logprob, token_id, text] per token; the first token's come through the aux slot
    g, w = got["output_token_logprobs"], want["output_token_logprobs"]
    assert [x[1] for x in g] == [x[1] for x in w]
    assert [x[0] for x in g] == pytest.approx([x[0] for x in w], abs=1e-4)
    g, w = got["output_top_logprobs"], want["output_top_logprobs"]
    assert [[x[1] for x in t] for t in g] == [[x[1] for x in t] for t in w]
    assert [x[0] for t in g for x in t] == pytest.approx([x[0] for t in w for x in t], abs=1e-4)
    P.wait_unleaked()
    D.wait_unleaked()
