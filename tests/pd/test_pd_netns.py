"""1P1D with prefill, decode and the router in three network namespaces joined by a bridge.

The KV crosses veth interfaces between distinct addresses (198.51.100.0/24, RFC 5737);
the bootstrap host is the prefill namespace's address. Needs root (``ip netns``);
skipped with the reason where that is not permitted. The namespaces are removed
whatever happens.
"""

from __future__ import annotations

import json
import sys

import pytest
from support.netns_stand import NET, namespaces, ns_request, wait_up
from support.netns_util import tx_bytes
from support.pd_stand import Proc, Server, greedy_body, prompt_ids

pytestmark = pytest.mark.timeout(400)

ADDRS = {"p": f"{NET}.11", "d": f"{NET}.12", "r": f"{NET}.13"}


@pytest.fixture(scope="module")
def netns():
    with namespaces(ADDRS) as names:
        yield names


def test_1p1d_router_across_three_namespaces(netns, reference, request):
    request.getfixturevalue("colocated")
    prefix = lambda k: ["ip", "netns", "exec", netns[k]]  # noqa: E731
    P = Server("netns-P", "prefill", "--max-total-tokens", "2048", host=ADDRS["p"], cmd_prefix=prefix("p"))
    D = Server("netns-D", "decode", "--max-total-tokens", "2048", host=ADDRS["d"], cmd_prefix=prefix("d"))
    router = None
    try:
        wait_up(netns["p"], P.url + "/health", [P])
        wait_up(netns["d"], D.url + "/health", [D])
        router_url = f"http://{ADDRS['r']}:30000"
        router = Proc("netns-router", [sys.executable, "-m", "pdserve.router", "--prefill", P.url,
                                       str(P.bootstrap_port), "--decode", D.url, "--host", ADDRS["r"],
                                       "--port", "30000"], cmd_prefix=prefix("r"))
        wait_up(netns["r"], router_url + "/health", [router], timeout=60)
        before = tx_bytes(netns["p"], "ethp")
        ids = prompt_ids(150, seed=77)
        status, text = ns_request(netns["r"], "POST", router_url + "/generate", greedy_body(ids, 6))
        assert status == 200, text
        assert json.loads(text)["output_ids"] == reference(ids, 6)
        # 150 tokens of KV: 30 layers x K/V x 3 heads x 64 dims x fp32 left the prefill namespace
        kv_bytes = 150 * 30 * 2 * 3 * 64 * 4
        assert tx_bytes(netns["p"], "ethp") - before >= kv_bytes
    finally:
        if router is not None:
            router.stop()
        P.stop()
        D.stop()
