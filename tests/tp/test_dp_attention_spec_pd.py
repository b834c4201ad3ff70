"""NEXTN through PD under DP attention, as SGLang serves DeepSeek in production: prefill and decode
both ``--tp-size 2 --dp-size 2 --enable-dp-attention --speculative-algorithm NEXTN``, over Mooncake,
fp32, on a tiny DeepSeek-V3 of six layers, all but the last silenced, whose MTP layer copies that
last layer (so drafts are accepted). The prefill's MTP forwards over the prompt are draft rounds,
which a prefill group without prompt rows answers with the MTP's idle forward; the decode's MTP
starts from the handed-off hidden state and prompt KV and drafts in draft rounds.

Requests on every group of both sides at once (each prefill group into the other decode group):
greedy output equals a colocated server's without speculation, each decode group ran the requests
named to it, drafts were accepted, and both PD servers end unleaked. One stand of three servers.
"""

from __future__ import annotations

import threading

import pytest
from support.deepseek_util import add_mtp_layer, make_deepseek_checkpoint
from support.pd_stand import Server, greedy_body, pd_post, serving
from test_dp_attention_pd import dispatched
from test_dp_attention_spec import LAYERS, silence_layers_before_last
from test_tp_server import PROMPTS

pytestmark = pytest.mark.timeout(600)

MAX_NEW = 16
DP_NEXTN = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--speculative-algorithm", "NEXTN",
            "--speculative-num-draft-tokens", "3")


@pytest.fixture(scope="module")
def stand(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ds-v3-mtp-dp"))
    make_deepseek_checkpoint("v3", path, num_hidden_layers=LAYERS)
    silence_layers_before_last(path)
    add_mtp_layer(path, copy_last=True)
    flags = ("--model-path", path, "--max-total-tokens", "2048", "--dtype", "float32")
    servers = {"C": Server("dpmtp-C", "null", *flags), "P": Server("dpmtp-P", "prefill", *flags, *DP_NEXTN),
               "D": Server("dpmtp-D", "decode", *flags, *DP_NEXTN)}
    with serving(servers):
        yield servers


def test_nextn_pd_under_dp_attention_equals_colocated(stand):
    C, P, D = stand["C"], stand["P"], stand["D"]
    want = []
    for ids in PROMPTS:
        r = C.post("/generate", greedy_body(ids, MAX_NEW))
        assert r.status_code == 200, r.text
        want.append(r.json()["output_ids"])

    # prompt i: prefill group i % 2 into decode group (i + 1) % 2, all at once
    groups = [(i % 2, (i + 1) % 2) for i in range(len(PROMPTS))]
    before = dispatched(D)
    out: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i, g=g: out.setdefault(i, pd_post(
        P, D, "/generate", greedy_body(PROMPTS[i], MAX_NEW), prefill_dp_rank=g[0], decode_dp_rank=g[1],
        timeout=300))) for i, g in enumerate(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(320)
    for i in range(len(PROMPTS)):
        pr, dr = out[i]
        assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text, P.log(1500), D.log(1500))
        assert dr.json()["output_ids"] == want[i], i
    after = dispatched(D)
    for rank in ("0", "1"):
        assert after[rank] - before.get(rank, 0) == sum(1 for _, d in groups if str(d) == rank)
    accepted = [out[i][1].json()["meta_info"].get("spec_accept_token_num", 0) for i in range(len(PROMPTS))]
    assert sum(accepted) > 0, accepted
    P.wait_unleaked()
    D.wait_unleaked()
