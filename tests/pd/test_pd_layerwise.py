"""Layer-wise KV send between real servers (``--disaggregation-layerwise`` on the prefill side): greedy
fp32 outputs equal the chunk-level prefill's and the colocated server's, for prompts of one chunk and
of several, over Mooncake (TCP) and NIXL (UCX). Each scenario ends with the pools unleaked.

Stand: over Mooncake a layer-wise prefill PL and a chunk-level one PC in front of one decode D (the
decode side needs no flag: the same writes land, layer by layer); over NIXL a layer-wise PN and DN.
Failures between layers are covered in one process (``tests/layerwise``), where they can be placed.
"""

from __future__ import annotations

import pytest
from support.pd_stand import Server, greedy_body, pd_post, prompt_ids, serving

pytestmark = pytest.mark.timeout(600)

# 64-token chunks (pd_stand.COMMON): 1 and 40 tokens are one chunk, 64 exactly one, 150 three
LENGTHS = [1, 40, 64, 150]
MAX_NEW = 5
LAYERWISE = "--disaggregation-layerwise"


@pytest.fixture(scope="module")
def stand(request):
    servers = {
        "PL": Server("PL", "prefill", "--max-total-tokens", "2048", LAYERWISE),
        "PC": Server("PC", "prefill", "--max-total-tokens", "2048", "--no-disaggregation-layerwise"),
        "D": Server("D", "decode", "--max-total-tokens", "2048"),
        "PN": Server("PN", "prefill", "--max-total-tokens", "2048", LAYERWISE, backend="nixl"),
        "DN": Server("DN", "decode", "--max-total-tokens", "2048", backend="nixl"),
    }
    with serving(servers, lambda: request.getfixturevalue("colocated")):
        yield servers


def _outputs(P: Server, D: Server, ids: list[int]) -> list[int]:
    p, d = pd_post(P, D, "/generate", greedy_body(ids, MAX_NEW))
    assert not isinstance(p, Exception) and not isinstance(d, Exception), (p, d)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert p.json()["output_ids"] == d.json()["output_ids"][:1], "the prefill answers with the first token"
    return d.json()["output_ids"]


def test_layerwise_equals_chunk_level_and_colocated_over_mooncake(stand, reference):
    PL, PC, D = stand["PL"], stand["PC"], stand["D"]
    for n in LENGTHS:
        ids = prompt_ids(n, seed=7000 + n)
        layerwise, chunked = _outputs(PL, D, ids), _outputs(PC, D, ids)
        assert layerwise == chunked == reference(ids, MAX_NEW), n
    for s in (PL, PC, D):
        s.wait_unleaked()


def test_layerwise_equals_colocated_over_nixl(stand, reference):
    PN, DN = stand["PN"], stand["DN"]
    for n in LENGTHS:
        ids = prompt_ids(n, seed=7000 + n)
        assert _outputs(PN, DN, ids) == reference(ids, MAX_NEW), n
    PN.wait_unleaked()
    DN.wait_unleaked()
