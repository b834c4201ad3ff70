"""1P1D over Mooncake (TCP) for the architectures built from ``layers/`` (Qwen3-MoE, Gemma 3) on
tiny random checkpoints: the KV pages a prefill server writes carry them unchanged, so the decode
server's greedy tokens are transformers' own, for prompts within one chunk and across two (past
Gemma's sliding window too)."""

from __future__ import annotations

import pytest
from support.model_util import hf_greedy, hf_model, make_tiny_checkpoint
from support.pd_stand import Server, greedy_body, pd_post, serving

pytestmark = pytest.mark.timeout(600)
PROMPTS = [[5], [1, 5, 9, 33, 100, 7, 250], list(range(3, 73))]  # 70 tokens: two 64-token chunks
MAX_NEW = 6


KINDS = ["qwen3_moe", "gemma3"]


@pytest.fixture(scope="module")
def stand(tmp_path_factory):
    """{kind: (prefill, decode, transformers' greedy tokens per prompt)}; the four servers load at once."""
    servers, refs = {}, {}
    for kind in KINDS:
        path = str(tmp_path_factory.mktemp(f"pd_{kind}"))
        make_tiny_checkpoint(kind, path)
        model = ["--model-path", path, "--max-total-tokens", "2048"]
        servers[kind + "P"] = Server(f"{kind}P", "prefill", *model)
        servers[kind + "D"] = Server(f"{kind}D", "decode", *model)
        hf = hf_model(path)  # while the servers load
        refs[kind] = [hf_greedy(hf, ids, MAX_NEW)[0] for ids in PROMPTS]
    with serving(servers):
        yield {kind: (servers[kind + "P"], servers[kind + "D"], refs[kind]) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_1p1d_greedy_equals_transformers(stand, kind):
    P, D, want = stand[kind]
    for ids, ref in zip(PROMPTS, want):
        p, d = pd_post(P, D, "/generate", greedy_body(ids, MAX_NEW))
        assert not isinstance(p, Exception) and not isinstance(d, Exception), (p, d)
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        assert p.json()["output_ids"] == ref[:1], "the prefill answers with the first token only"
        assert d.json()["output_ids"] == ref, len(ids)
    P.wait_unleaked()
    D.wait_unleaked()
