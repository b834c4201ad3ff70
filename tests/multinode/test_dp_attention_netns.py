"""DP attention across two namespaces ("nodes"): ``--tp-size 2 --dp-size 2 --enable-dp-attention
--nnodes 2`` of a tiny Llama (fp32), one attention group per node, the MLPs split over both.

Node 1 starts first (its ranks wait for the world at node 0's ``--dist-init-addr``, and its group
leader for node 0's rank channel at port + 1). Greedy outputs equal a colocated TP 1 server's,
for requests on group 0, on group 1 (``routed_dp_rank``) and a batch over both; both pools are
unleaked after. The rank channel listens on node 0's address only. Then node 1's rank is
SIGKILLed under a request on its group: the request ends 503 naming the dead DP and TP rank,
node 0 exits 1, node 1 too. Needs root (``ip netns``); skipped with the reason where that is
not permitted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time

import pytest
from server_helpers import rank_pids
from support.netns_stand import NET, namespaces, ns_request, ns_requests_results, ns_requests_started, wait_up
from support.netns_stand import wait_unleaked
from support.pd_stand import Server, wait_for

from pdserve.entrypoints.procs import free_port

pytestmark = pytest.mark.timeout(500)

ADDRS = {"n0": f"{NET}.41", "n1": f"{NET}.42"}
POOL = ["--max-total-tokens", "1024"]
DIST_TIMEOUT = 30  # the start-up rendezvous of two nodes on a loaded machine fits well within it


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(8, 90))] for _ in range(n)]


def greedy(ids: list[int], max_new: int = 12, **extra) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
            **extra}


@pytest.fixture(scope="module")
def stand(tiny):
    """Node 0 and node 1 of the server, node 1 started first; yields (namespaces, nodes, port)."""
    dist_port = free_port()
    with namespaces(ADDRS) as ns:
        nodes = []
        try:
            for rank in (1, 0):
                key = f"n{rank}"
                # gloo binds the interface of the hostname's address, which no namespace has: name it
                nodes.append(Server(
                    f"dpa-{key}", "null", "--model-path", tiny, *POOL, "--tp-size", "2", "--dp-size", "2",
                    "--enable-dp-attention", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr",
                    f"{ADDRS['n0']}:{dist_port}", "--dist-timeout", str(DIST_TIMEOUT), host=ADDRS[key],
                    env={"GLOO_SOCKET_IFNAME": f"eth{key}"}, cmd_prefix=["ip", "netns", "exec", ns[key]]))
                if rank == 1:
                    time.sleep(2.0)  # node 1 is up and waiting before node 0 exists
            nodes.reverse()
            wait_up(ns["n0"], nodes[0].url + "/health", nodes)
            yield ns, nodes, dist_port
        finally:
            for node in nodes:
                node.stop()


@pytest.fixture(scope="module")
def ref_server(tiny):
    """The colocated TP 1 server of the same checkpoint: the reference of every greedy output."""
    s = Server("dpa-ref", "null", "--model-path", tiny, *POOL)
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_groups_on_two_nodes_equal_tp1(stand, ref_server):
    ns, (n0, n1), dist_port = stand
    logs = lambda: n0.log() + "\n" + n1.log()  # noqa: E731
    bodies = [greedy(ids) for ids in prompts(6)]
    want = [ref_server.post("/generate", b).json()["output_ids"] for b in bodies]
    for group in (0, 1):  # one request on each group
        status, text = ns_request(ns["n0"], "POST", n0.url + "/generate", dict(bodies[group], routed_dp_rank=group))
        assert status == 200, text + "\n" + logs()
        assert json.loads(text)["output_ids"] == want[group], group
    # a batch over both groups at once (the front end spreads them round robin)
    batch = ns_requests_started(ns["n0"], n0.url + "/generate", bodies[2:], [0.0] * 4)
    for (status, text, _), w in zip(ns_requests_results(batch, timeout=300), want[2:]):
        assert status == 200, text + "\n" + logs()
        assert json.loads(text)["output_ids"] == w
    status, text = ns_request(ns["n0"], "GET", n0.url + "/get_server_info")
    states = json.loads(text)["internal_states"]
    assert len(states) == 2 and all(s["num_total_pages"] > 0 for s in states), states  # group 1's stats came
    wait_unleaked(ns["n0"], n0.url)
    # the rank channel (port + 1) listens on node 0's address, not on every interface
    listening = subprocess.run(["ip", "netns", "exec", ns["n0"], "ss", "-ltnH"], capture_output=True,
                               text=True).stdout
    assert f"{ADDRS['n0']}:{dist_port + 1} " in listening, listening
    assert f"*:{dist_port + 1} " not in listening and f"0.0.0.0:{dist_port + 1} " not in listening, listening


def test_a_dead_rank_on_node_1_takes_the_server_down(stand):
    ns, (n0, n1), _ = stand
    ranks = rank_pids(n1.proc.pid)
    assert list(ranks) == ["pdserve-dp1-tp0"], ranks
    inflight = ns_requests_started(ns["n0"], n0.url + "/generate", [greedy(prompts(1)[0], 400, routed_dp_rank=1)],
                                   [0.0])
    def running_on_group_1() -> bool:
        status, text = ns_request(ns["n0"], "GET", n0.url + "/get_server_info", timeout=10)
        return status == 200 and json.loads(text)["internal_states"][1]["num_running_reqs"] == 1

    wait_for(running_on_group_1, 60, "the request to run on group 1")
    os.kill(ranks["pdserve-dp1-tp0"], signal.SIGKILL)
    [(status, text, _)] = ns_requests_results(inflight, timeout=120)
    assert status == 503, text
    assert "DP rank 1 TP rank 0 exited with code -9" in json.loads(text)["error"]["message"], text
    assert n0.proc.wait(60) == 1, n0.log()
    assert n1.proc.wait(60) == 1, n1.log()
