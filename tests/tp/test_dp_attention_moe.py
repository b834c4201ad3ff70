"""DP attention over the tiny random Qwen3-MoE (fp32): ``--tp-size 2 --dp-size 2
--enable-dp-attention`` with the experts split over both attention groups by their rows (each
group's rows gathered around the experts), and with ``--ep-size 2 --moe-a2a-backend gloo`` (each
group sends its own rows to the experts' ranks). Greedy output equals TP 1 with a batch spread
over both groups and with one group idle.
"""

from __future__ import annotations

import threading

import pytest
from server_helpers import ServerProcess
from test_tp_server import PROMPTS

from pdserve.entrypoints.engine import Engine

pytestmark = pytest.mark.timeout(300)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tp1_outputs(tiny_checkpoints):
    with Engine(model_path=tiny_checkpoints["qwen3_moe"], dtype="float32", max_total_tokens=2048) as engine:
        return [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]


@pytest.mark.parametrize("experts", [[], ["--ep-size", "2", "--moe-a2a-backend", "gloo"]], ids=["split", "ep-gloo"])
def test_moe_groups_equal_tp1(tiny_checkpoints, tp1_outputs, experts):
    server = ServerProcess("--model-path", tiny_checkpoints["qwen3_moe"], "--dtype", "float32", "--tp-size", "2",
                           "--dp-size", "2", "--enable-dp-attention", "--max-total-tokens", "2048", *experts)
    try:
        server.wait_ready()
        results: list = [None] * len(PROMPTS)

        def ask(i: int) -> None:
            results[i] = server.post("/generate", {"input_ids": PROMPTS[i], "sampling_params": GREEDY,
                                                   "routed_dp_rank": i % 2})

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]  # both groups at once
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.json()["output_ids"] for r in results] == tp1_outputs
        # group 1 alone: group 0 idles through the experts' collectives
        r = server.post("/generate", {"input_ids": PROMPTS[2], "sampling_params": GREEDY, "routed_dp_rank": 1})
        assert r.json().get("output_ids") == tp1_outputs[2], (r.text, server.log())
        server.wait_idle_and_unleaked()
    finally:
        server.stop()
