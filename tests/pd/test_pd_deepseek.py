"""A tiny DeepSeek-V3 (MLA: a latent KV pool) through 1P1D over Mooncake: greedy output identical to
the colocated server's at P TP 1 -> D TP 1, P TP 2 -> D TP 1 and P TP 1 -> D TP 2 (one stand), and every
side's pool unleaked after."""

from __future__ import annotations

import pytest
from support.pd_stand import Server, assert_pd_equals_colocated, serving

from support.deepseek_util import make_deepseek_checkpoint

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ds_stand(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ds-v3"))
    make_deepseek_checkpoint("v3", path)
    flags = ("--model-path", path, "--max-total-tokens", "1024")
    servers = {name: Server(name, mode, *flags) for name, mode in
               (("C", "null"), ("P", "prefill"), ("D", "decode"))}
    servers["P2"] = Server("P2", "prefill", *flags, "--tp-size", "2")
    servers["D2"] = Server("D2", "decode", *flags, "--tp-size", "2")
    with serving(servers):
        yield servers


@pytest.mark.parametrize("pair", [("P", "D"), ("P2", "D"), ("P", "D2")])
def test_deepseek_1p1d_greedy_equals_colocated(ds_stand, pair):
    c, p, d = ds_stand["C"], ds_stand[pair[0]], ds_stand[pair[1]]
    assert_pd_equals_colocated(c, p, d, 12)
