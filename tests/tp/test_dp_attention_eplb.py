"""EPLB under DP attention: ``--tp-size 2 --dp-size 2 --enable-dp-attention --ep-size 2
--moe-a2a-backend gloo --ep-num-redundant-experts 2 --enable-eplb`` on the tiny Qwen3-MoE (fp32).
The balancer steps per forward round, which every rank answers with its own forward or an idle
one, so it rebalances at the same round on both groups even while one group runs more forwards
than the other or none at all. Greedy output equals TP 1 (no EPLB) across the rebalances, and the
balancer's counters on ``/metrics`` say it rebalanced and moved experts, alike on both groups.

One server: a long request on group 0 beside a short one on group 1 (group 1 idles through most
rounds), then group 1 alone (group 0 idles through every round).
"""

from __future__ import annotations

import re
import threading

import pytest
from server_helpers import ServerProcess
from support.pd_stand import wait_for
from test_tp_server import PROMPTS

from pdserve.entrypoints.engine import Engine

pytestmark = pytest.mark.timeout(300)

LONG = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
SHORT = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
EVERY = 2  # rounds between rebalances


def eplb_counters(server) -> dict[str, tuple[float, float]]:
    """{dp_rank: (rebalances, moved expert copies)} from /metrics (each group has one rank)."""
    text = server.get("/metrics").text
    out = {}
    for rank in ("0", "1"):
        values = []
        for name in ("pdserve_eplb_rebalances_total", "pdserve_eplb_moved_experts_total"):
            found = re.search(rf'{name}{{[^}}]*dp_rank="{rank}",tp_rank="0"[^}}]*}} (\S+)', text)
            values.append(float(found.group(1)) if found else -1.0)
        out[rank] = tuple(values)
    return out


def settled_counters(server, above: float) -> tuple[float, float]:
    """The counters once both groups report the same ones with more than ``above`` rebalances (each
    rank sends its metrics on its own)."""
    seen = {}

    def settled() -> bool:
        seen.update(eplb_counters(server))
        return seen["0"] == seen["1"] and seen["0"][0] > above

    wait_for(settled, 30, "both groups' EPLB counters")
    return seen["0"]


def test_eplb_rebalances_with_one_group_idle_greedy_equals_tp1(tiny_checkpoints):
    path = tiny_checkpoints["qwen3_moe"]
    with Engine(model_path=path, dtype="float32", max_total_tokens=2048) as engine:
        want_long = engine.generate(input_ids=PROMPTS[1], sampling_params=LONG)["output_ids"]
        want_short = [engine.generate(input_ids=PROMPTS[i], sampling_params=SHORT)["output_ids"] for i in (0, 2)]
    server = ServerProcess("--model-path", path, "--dtype", "float32", "--tp-size", "2", "--dp-size", "2",
                           "--enable-dp-attention", "--ep-size", "2", "--moe-a2a-backend", "gloo",
                           "--ep-num-redundant-experts", "2", "--enable-eplb",
                           "--eplb-rebalance-num-iterations", str(EVERY), "--max-total-tokens", "2048",
                           "--chunked-prefill-size", "16")  # group 0's 37-token prompt: three prefill forwards
    try:
        server.wait_ready()
        results = {}

        def ask(name: str, prompt: list[int], sampling: dict, group: int) -> None:
            results[name] = server.post("/generate", {"input_ids": prompt, "sampling_params": sampling,
                                                      "routed_dp_rank": group})

        # group 0 runs some 18 forwards, group 1 about 4: group 1 answers the rest with idle ones
        threads = [threading.Thread(target=ask, args=("long", PROMPTS[1], LONG, 0)),
                   threading.Thread(target=ask, args=("short", PROMPTS[0], SHORT, 1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(results) == {"long", "short"}, server.log()  # a request that raised has none
        assert results["long"].json().get("output_ids") == want_long, (results["long"].text, server.log())
        assert results["short"].json().get("output_ids") == want_short[0], (results["short"].text, server.log())
        rebalances, moved = settled_counters(server, 0)
        assert moved > 0, server.log()

        # group 1 alone: group 0 idles through every round, and rebalances with it
        ask("alone", PROMPTS[2], SHORT, 1)
        assert results["alone"].json().get("output_ids") == want_short[1], (results["alone"].text, server.log())
        later, moved_later = settled_counters(server, rebalances)
        assert later > rebalances and moved_later >= moved
        server.wait_idle_and_unleaked()
    finally:
        server.stop()
