"""A prefill and a decode server whose TP ranks span two namespaces each ("nodes"), behind the router.

Five namespaces on one bridge: node 0 and node 1 of the prefill server, node 0 and
node 1 of the decode server, and the router. Each server runs ``--tp-size 2
--nnodes 2`` of a tiny checkpoint (4 heads, 2 KV heads), one TP rank per node,
joined at node 0's ``--dist-init-addr``. Every prefill rank registers with the
bootstrap server on prefill node 0, and each decode rank pulls its heads from
the prefill rank that holds them, across namespaces. Greedy outputs equal a
colocated TP 1 server's; both servers' pools are unleaked after. Needs root
(``ip netns``); skipped with the reason where that is not permitted.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
from netns_stand import NET, namespaces, ns_request, wait_unleaked, wait_up
from pd_stand import Proc, Server

from pdserve.engine.procs import free_port

pytestmark = pytest.mark.timeout(500)

ADDRS = {"p0": f"{NET}.31", "p1": f"{NET}.32", "d0": f"{NET}.33", "d1": f"{NET}.34", "r": f"{NET}.35"}
POOL = ["--max-total-tokens", "1024"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model_util import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("tiny-llama"))
    make_tiny_checkpoint("llama", path)
    return path


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(8, 90))] for _ in range(n)]


def greedy(ids: list[int], max_new: int = 12) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}


def two_node_server(name: str, mode: str, ns: dict, model: str, backend: str) -> list[Server]:
    """Node 0 and node 1 of one TP 2 server, in namespaces ``ns[name+'0']`` and ``ns[name+'1']``."""
    head = ADDRS[f"{name}0"]
    dist = f"{head}:{free_port()}"
    bootstrap = str(free_port())
    nodes = []
    for rank in (0, 1):
        key = f"{name}{rank}"
        # gloo binds the interface of the hostname's address, which no namespace has: name it
        env = {"GLOO_SOCKET_IFNAME": f"eth{key}", "UCX_TLS": "tcp"}
        extra = ["--model-path", model, *POOL, "--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank),
                 "--dist-init-addr", dist]
        if mode == "prefill":
            extra += ["--disaggregation-bootstrap-port", bootstrap]  # the same on every node
        nodes.append(Server(f"mn-{key}", mode, *extra, host=ADDRS[key], backend=backend, env=env,
                            cmd_prefix=["ip", "netns", "exec", ns[key]]))
    if mode == "prefill":
        nodes[0].bootstrap_port = int(bootstrap)
    return nodes


@pytest.fixture(scope="module")
def ref_server(tiny):
    """The colocated TP 1 server of the same checkpoint: the reference of every greedy output."""
    s = Server("mn-ref", "null", "--model-path", tiny, *POOL)
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_two_node_prefill_and_decode_behind_the_router(tiny, ref_server, backend):
    """NIXL runs with UCX_TLS=tcp (within one host UCX would take shared memory)."""
    procs: list[Proc] = []
    try:
        with namespaces(ADDRS) as ns:
            p_nodes = two_node_server("p", "prefill", ns, tiny, backend)
            d_nodes = two_node_server("d", "decode", ns, tiny, backend)
            procs += p_nodes + d_nodes
            ref_server.wait_ready()
            P, D = p_nodes[0], d_nodes[0]
            wait_up(ns["p0"], P.url + "/health", p_nodes)
            wait_up(ns["d0"], D.url + "/health", d_nodes)
            router_url = f"http://{ADDRS['r']}:30000"
            router = Proc("mn-router", [sys.executable, "-m", "pdserve.router", "--prefill", P.url,
                                        str(P.bootstrap_port), "--decode", D.url, "--host", ADDRS["r"],
                                        "--port", "30000", "--log-level", "warning"],
                          cmd_prefix=["ip", "netns", "exec", ns["r"]])
            procs.append(router)
            wait_up(ns["r"], router_url + "/health", [router], timeout=60)
            for ids in prompts(4):
                want = ref_server.post("/generate", greedy(ids)).json()["output_ids"]
                status, text = ns_request(ns["r"], "POST", router_url + "/generate", greedy(ids))
                assert status == 200, text + "\n" + P.log() + p_nodes[1].log() + D.log()
                assert json.loads(text)["output_ids"] == want, len(ids)
            wait_unleaked(ns["p0"], P.url)
            wait_unleaked(ns["d0"], D.url)
            for p in procs[::-1]:
                p.stop()
    finally:
        for p in procs[::-1]:
            p.stop()
