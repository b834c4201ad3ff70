"""PD with DP attention groups of two ranks on the tiny Llama (fp32), over Mooncake and NIXL:
prefill P and decode D both ``--tp-size 4 --dp-size 2 --enable-dp-attention`` (each group is a
KV rank set of two, sending and receiving as a TP 2 server does), and decode D2 a plain
``--tp-size 2``. Crossed group pairs and each prefill group into D2 give the colocated TP 1
output; the named decode group is the one that ran it; every pool ends unleaked.
"""

from __future__ import annotations

import pytest
from support.pd_stand import Server
from test_dp_attention_pd import PROMPTS, dispatched, generate, reference  # noqa: F401 - reference: a fixture

pytestmark = pytest.mark.timeout(600)

GROUPS = ("--tp-size", "4", "--dp-size", "2", "--enable-dp-attention")


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def stand(request, tiny_checkpoints):
    backend = request.param
    if backend == "nixl":
        pytest.importorskip("nixl")
    model = ["--model-path", tiny_checkpoints["llama"], "--max-total-tokens", "2048"]
    servers = {"P": Server(f"dpgroups-P-{backend}", "prefill", *model, *GROUPS, backend=backend),
               "D": Server(f"dpgroups-D-{backend}", "decode", *model, *GROUPS, backend=backend),
               "D2": Server(f"dpgroups-D2-{backend}", "decode", *model, "--tp-size", "2", backend=backend)}
    try:
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


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
