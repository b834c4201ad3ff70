"""``pdserve serve --tp-size 2 --dp-size 2 --enable-dp-attention`` on a tiny Llama: two attention
groups, each its own scheduler and KV pool, the MLPs split over both. Greedy output equals TP 1
with a batch spread over both groups, a group works while the other idles, a named group is
honoured (and one out of range refused), and a group's death takes the server down.

One server for the module; the fault test runs last and ends it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
from server_helpers import ServerProcess, is_running, rank_pids
from test_tp_server import PROMPTS
from support.pd_stand import wait_for

from pdserve.engine.config import EngineConfig
from pdserve.engine.server_config import ServerConfig
from pdserve.entrypoints.engine import Engine

pytestmark = pytest.mark.timeout(300)

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def dp_server(tiny_checkpoints):
    server = ServerProcess("--model-path", tiny_checkpoints["llama"], "--dtype", "float32", "--tp-size", "2",
                           "--dp-size", "2", "--enable-dp-attention", "--max-total-tokens", "2048",
                           "--chunked-prefill-size", "16")  # a 37-token prompt: a middle chunk samples no row
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tp1_outputs(tiny_checkpoints):
    with Engine(model_path=tiny_checkpoints["llama"], dtype="float32", max_total_tokens=2048) as engine:
        return [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]


def dispatched(server) -> dict[str, float]:
    """pdserve_requests_total per dp_rank."""
    text = server.get("/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'pdserve_requests_total\{[^}]*dp_rank="(\d)"[^}]*\} (\S+)', text)}


def generate(server, i: int, **fields):
    return server.post("/generate", {"input_ids": PROMPTS[i], "sampling_params": GREEDY, **fields})


def test_batch_over_both_groups_equals_tp1(dp_server, tp1_outputs):
    info = dp_server.server_info()
    assert info["dp_size"] == 2 and info["enable_dp_attention"] is True
    assert sorted(rank_pids(dp_server.proc.pid)) == ["pdserve-dp0-tp0", "pdserve-dp1-tp0"]
    before = dispatched(dp_server)
    results: list = [None] * len(PROMPTS)

    def ask(i: int) -> None:
        results[i] = generate(dp_server, i)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]  # batched together
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.json()["output_ids"] for r in results] == tp1_outputs
    after = dispatched(dp_server)
    assert after.get("0", 0) > before.get("0", 0) and after.get("1", 0) > before.get("1", 0), (before, after)
    dp_server.wait_idle_and_unleaked()


@pytest.mark.parametrize("field", ["routed_dp_rank", "data_parallel_rank"])
def test_one_group_works_while_the_other_idles(dp_server, tp1_outputs, field):
    for rank in (0, 1):
        before = dispatched(dp_server)
        r = generate(dp_server, 1, **{field: rank})
        assert r.json()["output_ids"] == tp1_outputs[1]
        after = dispatched(dp_server)
        assert after[str(rank)] == before.get(str(rank), 0) + 1
        assert after[str(1 - rank)] == before.get(str(1 - rank), 0)  # the other group only joined its MLPs
    dp_server.wait_idle_and_unleaked()


def test_group_out_of_range_is_refused(dp_server):
    r = generate(dp_server, 0, routed_dp_rank=2)
    assert r.status_code == 400
    assert "routed_dp_rank" in r.json()["error"]["message"]


def test_per_group_load_on_metrics(dp_server):
    text = dp_server.get("/metrics").text
    for name in ("num_running_reqs", "num_waiting_reqs", "num_running_tokens", "num_queued_tokens"):
        for rank in ("0", "1"):
            assert re.search(rf'pdserve_{name}\{{[^}}]*dp_rank="{rank}"', text), name


def test_refused_shapes_are_named():
    for mode in ("null", "prefill", "decode"):  # groups of two ranks, colocated or PD
        assert ServerConfig(tp_size=4, dp_size=2, enable_dp_attention=True, disaggregation_mode=mode).attn_tp_size == 2
    with pytest.raises(ValueError, match="dp_size dividing tp_size"):
        ServerConfig(tp_size=2, dp_size=3, enable_dp_attention=True)
    for mode in ("prefill", "decode"):  # NEXTN in PD: the prefill's prompt MTP runs draft rounds
        assert ServerConfig(EngineConfig(speculative_algorithm="NEXTN"), tp_size=2, dp_size=2,
                            enable_dp_attention=True, disaggregation_mode=mode).engine.speculative_algorithm == "NEXTN"
    # EPLB is served (it steps per forward round: tests/tp/test_dp_attention_eplb.py)
    assert ServerConfig(EngineConfig(ep_size=2, moe_a2a_backend="gloo", enable_eplb=True), tp_size=2, dp_size=2,
                        enable_dp_attention=True).engine.enable_eplb
    with pytest.raises(ValueError, match="enable_dp_attention is not supported with moe_a2a_backend 'deepep'"):
        ServerConfig(EngineConfig(device="cuda", ep_size=2, moe_a2a_backend="deepep"), tp_size=2, dp_size=2,
                     enable_dp_attention=True)


def test_layouts_across_nodes():
    """World rank g * A + a on node w // (T / N): whole groups per node, or whole nodes per group;
    a group cut inside a node's share is refused naming the flags."""
    def config(tp, dp, nnodes, node_rank=0):
        return ServerConfig(tp_size=tp, dp_size=dp, enable_dp_attention=True, nnodes=nnodes, node_rank=node_rank,
                            dist_init_addr="10.0.0.1:5000")

    # one group per node; SGLang's 2 x 8 GPUs with --tp 16 --dp 16 (groups of one)
    assert config(2, 2, 2, 1).local_ranks() == [(1, 0)]
    assert config(16, 16, 2, 1).local_ranks() == [(g, 0) for g in range(8, 16)]
    # two whole groups of two on each node; a group of four over two nodes of two ranks
    assert config(8, 4, 2, 1).local_ranks() == [(2, 0), (2, 1), (3, 0), (3, 1)]
    c = config(8, 2, 4, 1)
    assert c.local_ranks() == [(0, 2), (0, 3)] and c.node_of(0, 0) == 0 and c.node_of(1, 0) == 2
    assert c.rank_channel_addr == "tcp://10.0.0.1:5001"  # the world meets at 5000
    assert config(8, 2, 4, 3).host_ranks == 2
    # CUDA: a node's ranks take its devices from --base-gpu-id in rank order
    on_gpus = ServerConfig(EngineConfig(device="cuda"), tp_size=16, dp_size=16, enable_dp_attention=True, nnodes=2,
                           node_rank=1, dist_init_addr="10.0.0.1:5000")
    assert [on_gpus.rank_device(g, 0) for g in (8, 15)] == ["cuda:0", "cuda:7"]
    for tp, dp, nnodes in ((6, 2, 3), (12, 4, 3), (4, 4, 3)):  # groups of 3 over shares of 2, 4; T % N
        with pytest.raises(ValueError, match="--tp-size .* --dp-size .* --nnodes"):
            config(tp, dp, nnodes)
    with pytest.raises(ValueError, match="nnodes > 1 needs dist_init_addr"):
        ServerConfig(tp_size=2, dp_size=2, enable_dp_attention=True, nnodes=2)
    with pytest.raises(ValueError, match="dist_init_addr must be host:port"):  # no port + 1 for the channel
        ServerConfig(tp_size=2, dp_size=2, enable_dp_attention=True, nnodes=2, dist_init_addr="10.0.0.1:65535")
    # what DP attention refuses on one node it refuses across nodes
    assert ServerConfig(EngineConfig(speculative_algorithm="NEXTN"), tp_size=2, dp_size=2, enable_dp_attention=True,
                        nnodes=2, dist_init_addr="10.0.0.1:5000",
                        disaggregation_mode="decode").engine.speculative_algorithm == "NEXTN"
    with pytest.raises(ValueError, match="enable_dp_attention is not supported with enable_lora"):
        ServerConfig(EngineConfig(enable_lora=True, max_loras_per_batch=1), tp_size=2, dp_size=2,
                     enable_dp_attention=True, nnodes=2, dist_init_addr="10.0.0.1:5000")
    # without DP attention a multi-node server is still one DP rank
    with pytest.raises(ValueError, match="needs dp_size 1"):
        ServerConfig(tp_size=2, dp_size=2, nnodes=2, dist_init_addr="10.0.0.1:5000")


def test_killed_group_takes_the_server_down(dp_server):
    pids = rank_pids(dp_server.proc.pid)
    result = {}

    def long_request() -> None:
        result["r"] = dp_server.post("/generate", {
            "input_ids": PROMPTS[0], "routed_dp_rank": 0,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: dp_server.server_info()["internal_states"][0]["num_running_tokens"] > 0, 30,
             "the request to start")
    states = dp_server.server_info()["internal_states"]
    assert states[0]["num_running_reqs"] == 1 and states[1]["num_running_tokens"] == 0  # the load per group
    os.kill(pids["pdserve-dp1-tp0"], signal.SIGKILL)  # the idle group: the working one waits on its MLPs
    t.join(60)
    r = result["r"]
    assert r.status_code == 503
    assert "DP rank 1 TP rank 0 exited with code -9" in r.json()["error"]["message"], r.text
    assert dp_server.proc.wait(30) == 1
    for pid in pids.values():
        deadline = time.monotonic() + 10
        while is_running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_running(pid), f"rank process {pid} left behind"
