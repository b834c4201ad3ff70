"""NEXTN through real PD servers (``pdserve serve``, Mooncake TCP on loopback): a tiny DeepSeek-V3
whose MTP layer copies its layer, prefill and decode both started with ``--speculative-algorithm
NEXTN``, at P TP 1 -> D TP 1, P TP 2 -> D TP 1 and P TP 1 -> D TP 2 (the hidden state comes from
the one prefill rank that writes the aux data). Greedy fp32 output equals a colocated server's
without speculation, and every server's pool is unleaked after."""

from __future__ import annotations

import pytest
from support.deepseek_util import add_mtp_layer, make_deepseek_checkpoint
from support.pd_stand import Server, assert_pd_equals_colocated, serving

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stand(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ds-v3-mtp-copy"))
    make_deepseek_checkpoint("v3", path, num_hidden_layers=1, first_k_dense_replace=2)
    add_mtp_layer(path, copy_last=True)
    flags = ("--model-path", path, "--max-total-tokens", "1024", "--dtype", "float32")
    nextn = ("--speculative-algorithm", "NEXTN", "--speculative-num-draft-tokens", "3")
    servers = {"C": Server("C", "null", *flags),
               "P": Server("P", "prefill", *flags, *nextn), "D": Server("D", "decode", *flags, *nextn),
               "P2": Server("P2", "prefill", *flags, *nextn, "--tp-size", "2"),
               "D2": Server("D2", "decode", *flags, *nextn, "--tp-size", "2")}
    with serving(servers):
        yield servers


@pytest.mark.parametrize("pair", [("P", "D"), ("P2", "D"), ("P", "D2")])
def test_nextn_1p1d_greedy_equals_colocated(stand, pair):
    c, p, d = stand["C"], stand[pair[0]], stand[pair[1]]
    assert_pd_equals_colocated(c, p, d, 16)
