"""DP attention with attention groups of several ranks: ``--tp-size 4 --dp-size 2
--enable-dp-attention``, two groups of two ranks, each group's heads split over its ranks (MLA's
latent KV whole on each), the dense MLPs and the experts split over all four. Greedy output
(fp32) equals TP 1 with a batch spread over both groups and with one group idle, for the tiny
Llama and the tiny DeepSeek-V3 (multi-head latent attention, a dense first layer, shared and
routed experts), and for the tiny Qwen3-MoE with whole experts exchanged by all-to-all (each rank
of a group sends its share of the group's rows), whose recorded expert counts cover both groups.

One four-rank server per model: on a shared 2-core machine each stand is slow, so each test
asks everything of its one stand; the Llama one ends by killing a follower rank of the idle
group, which takes the server down.
"""

from __future__ import annotations

import os
import re
import signal
import threading

import pytest
from server_helpers import ServerProcess, post_to_groups, rank_pids
from support.deepseek_util import make_deepseek_checkpoint
from support.pd_stand import wait_for
from test_tp_server import PROMPTS

from pdserve.entrypoints.engine import Engine

pytestmark = pytest.mark.timeout(600)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
GROUPS = ("--tp-size", "4", "--dp-size", "2", "--enable-dp-attention", "--dtype", "float32",
          "--max-total-tokens", "2048")
RANKS = ["pdserve-dp0-tp0", "pdserve-dp0-tp1", "pdserve-dp1-tp0", "pdserve-dp1-tp1"]


def tp1_outputs(path: str, sampling: dict = GREEDY) -> list[list[int]]:
    """Each of PROMPTS through one in-process rank (TP 1), fp32: the reference output."""
    with Engine(model_path=path, dtype="float32", max_total_tokens=2048) as engine:
        return [engine.generate(input_ids=p, sampling_params=sampling)["output_ids"] for p in PROMPTS]


def dispatched(server) -> dict[str, float]:
    """pdserve_requests_total per dp_rank."""
    text = server.get("/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'pdserve_requests_total\{[^}]*dp_rank="(\d)"[^}]*\} (\S+)', text)}


def ran(out: dict) -> int:
    """Tokens the model ran for one request: the uncached prompt, then each output token but the last."""
    meta = out["meta_info"]
    return meta["prompt_tokens"] - meta["cached_tokens"] + meta["completion_tokens"] - 1


def check_groups_equal_tp1(path: str, *flags: str, kill_follower: bool = False, top_k: int = 0) -> None:
    """A server of two two-rank groups on ``path``: a batch over both groups, then each group alone
    (the other idling through every MLP's collectives), greedy equal to TP 1; pools unleaked. With
    ``kill_follower``: then group 1's rank 1 is killed while group 0 decodes, which ends the server.
    With ``top_k`` (a MoE model) the batch is recorded: the dump, summed over both groups, counts
    each token the groups ran ``top_k`` times per layer, whichever group's ranks hold its experts."""
    want = tp1_outputs(path)
    server = ServerProcess("--model-path", path, *GROUPS, *flags)
    try:
        server.wait_ready()
        info = server.server_info()
        assert info["dp_size"] == 2 and info["enable_dp_attention"] is True
        assert len(info["internal_states"]) == 2  # one scheduler per group
        assert sorted(rank_pids(server.proc.pid)) == RANKS
        if top_k:
            assert server.post("/start_expert_distribution_record", {}).status_code == 200
        results = post_to_groups(server, PROMPTS, GREEDY)  # both groups at once
        assert [r.json().get("output_ids") for r in results] == want, (results[0].text, server.log())
        if top_k:
            counts = server.post("/dump_expert_distribution_record", {}).json()["logical_count"]
            assert [sum(row) for row in counts] == [top_k * sum(ran(r.json()) for r in results)] * len(counts)
        for rank in (0, 1):  # one group works, the other idles
            before = dispatched(server)
            r = server.post("/generate", {"input_ids": PROMPTS[1], "sampling_params": GREEDY,
                                          "routed_dp_rank": rank})
            assert r.json().get("output_ids") == want[1], (r.text, server.log())
            after = dispatched(server)
            assert after[str(rank)] == before.get(str(rank), 0) + 1
            assert after.get(str(1 - rank), 0) == before.get(str(1 - rank), 0)
        server.wait_idle_and_unleaked()
        if kill_follower:
            kill_idle_follower(server)
    finally:
        server.stop()


def kill_idle_follower(server) -> None:
    """Kill group 1's rank 1 while group 0 runs a long request: the request ends 503 naming the dead
    rank, and the server exits 1."""
    pids = rank_pids(server.proc.pid)
    result = {}

    def long_request() -> None:
        result["r"] = server.post("/generate", {
            "input_ids": PROMPTS[0], "routed_dp_rank": 0,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}})

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: server.server_info()["internal_states"][0]["num_running_tokens"] > 0, 60,
             "the request to start")
    os.kill(pids["pdserve-dp1-tp1"], signal.SIGKILL)
    t.join(120)
    r = result["r"]
    assert r.status_code == 503
    assert "DP rank 1 TP rank 1 exited with code -9" in r.json()["error"]["message"], r.text
    assert server.proc.wait(60) == 1


def test_llama_groups_of_two_equal_tp1(tiny_checkpoints):
    check_groups_equal_tp1(tiny_checkpoints["llama"], "--chunked-prefill-size", "16", kill_follower=True)


def test_deepseek_v3_groups_of_two_equal_tp1(tmp_path):
    make_deepseek_checkpoint("v3", str(tmp_path))
    check_groups_equal_tp1(str(tmp_path))


def test_qwen3_moe_groups_of_two_all_to_all_equal_tp1(tiny_checkpoints):
    check_groups_equal_tp1(tiny_checkpoints["qwen3_moe"], "--ep-size", "4", "--moe-a2a-backend", "gloo", top_k=3)
