"""PD with DP attention groups of two ranks on the tiny Llama (fp32), over Mooncake and NIXL:
prefill P and decode D both ``--tp-size 4 --dp-size 2 --enable-dp-attention`` (each group is a
KV rank set of two, sending and receiving as a TP 2 server does), and decode D2 a plain
``--tp-size 2``. Crossed group pairs and each prefill group into D2 give the colocated TP 1
output; the named decode group is the one that ran it; every pool ends unleaked. The tiny
DeepSeek-V3 (multi-head latent attention: each group rank holds the whole latent KV) pairs the
same way over Mooncake.
"""

from __future__ import annotations

import pytest
from support.deepseek_util import make_deepseek_checkpoint
from support.pd_stand import Server, greedy_body, pd_post
from test_dp_attention_pd import MAX_NEW, PROMPTS, dispatched, dp_stand, generate, reference  # noqa: F401 - a fixture

from pdserve.entrypoints.engine import Engine

pytestmark = pytest.mark.timeout(600)

GROUPS = ("--tp-size", "4", "--dp-size", "2", "--enable-dp-attention")


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def stand(request, tiny_checkpoints):
    yield from dp_stand(request.param, tiny_checkpoints["llama"], "dpgroups", GROUPS)


def test_groups_of_two_pair_and_feed_a_tp2_decode(stand, reference):
    for p_rank, d_rank in ((0, 1), (1, 0)):  # crossed: a room leaves one group and lands in the other
        before = dispatched(stand["D"])
        generate(stand, p_rank, "D", d_rank, reference)
        after = dispatched(stand["D"])
        assert after[str(d_rank)] - before.get(str(d_rank), 0) == len(PROMPTS)
        assert after.get(str(1 - d_rank), 0) == before.get(str(1 - d_rank), 0)
    for p_rank in (0, 1):
        generate(stand, p_rank, "D2", None, reference)
    for name in ("P", "D", "D2"):
        stand[name].wait_unleaked()


def test_mla_groups_of_two_pair_crossed(tmp_path):
    path = str(tmp_path)
    make_deepseek_checkpoint("v3", path)
    with Engine(model_path=path, dtype="float32", max_total_tokens=2048) as engine:
        want = [engine.generate(input_ids=p, sampling_params=greedy_body(p, MAX_NEW)["sampling_params"])["output_ids"]
                for p in PROMPTS]
    model = ["--model-path", path, "--dtype", "float32", "--max-total-tokens", "2048"]
    prefill = Server("dpgroups-mla-P", "prefill", *model, *GROUPS)
    decode = Server("dpgroups-mla-D", "decode", *model, *GROUPS)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        for p_rank, d_rank in ((0, 1), (1, 0)):
            for ids, out in zip(PROMPTS, want):
                pr, dr = pd_post(prefill, decode, "/generate", greedy_body(ids, MAX_NEW), prefill_dp_rank=p_rank,
                                 decode_dp_rank=d_rank)
                assert pr.status_code == 200 and dr.status_code == 200, (pr.text, dr.text, decode.log(1500))
                assert dr.json()["output_ids"] == out
        prefill.wait_unleaked()
        decode.wait_unleaked()
    finally:
        prefill.stop()
        decode.stop()
