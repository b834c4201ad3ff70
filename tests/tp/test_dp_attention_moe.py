"""DP attention over MoE models (fp32): the tiny random Qwen3-MoE and DeepSeek-V3 (multi-head
latent attention, a dense first layer, shared and routed experts) at ``--tp-size 2 --dp-size 2
--enable-dp-attention``, with the experts split over both attention groups by their rows (each
group's rows gathered around them), and with ``--ep-size 2 --moe-a2a-backend gloo`` (each group
sends its own rows to the experts' ranks, also under a placement file with redundant expert slots;
DeepSeek's shared experts gathered apart). Greedy output
equals TP 1 with a batch spread over both groups and with one group idle.
"""

from __future__ import annotations

import json
import os

import pytest
from server_helpers import ServerProcess, post_to_groups
from support.deepseek_util import make_deepseek_checkpoint
from test_tp_server import PROMPTS

from pdserve.entrypoints.engine import Engine

pytestmark = pytest.mark.timeout(300)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
EXPERTS = {"split": [], "ep-gloo": ["--ep-size", "2", "--moe-a2a-backend", "gloo"],
           # a placement file: experts in reverse order plus replicas of experts 0 and 1, so each group
           # must route its own rows to physical slots, not to the logical ids
           "ep-gloo-placed": ["--ep-size", "2", "--moe-a2a-backend", "gloo", "--ep-num-redundant-experts", "2"]}


def placement_file(checkpoint: str, out_dir) -> str:
    """--init-expert-location: every layer's slots holding experts E-1 .. 0, then 0 and 1."""
    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg["n_routed_experts"]
    row = list(range(experts - 1, -1, -1)) + [0, 1]
    path = os.path.join(out_dir, "placement.json")
    with open(path, "w") as f:
        json.dump({"physical_to_logical_map": [row] * cfg["num_hidden_layers"]}, f)
    return path


@pytest.fixture(scope="module")
def moe_models(tiny_checkpoints, tmp_path_factory):
    """{name: (checkpoint, TP 1 outputs of PROMPTS)}."""
    deepseek = str(tmp_path_factory.mktemp("tiny-deepseek-v3"))
    make_deepseek_checkpoint("v3", deepseek)
    out = {}
    for name, path in (("qwen3_moe", tiny_checkpoints["qwen3_moe"]), ("deepseek_v3", deepseek)):
        with Engine(model_path=path, dtype="float32", max_total_tokens=2048) as engine:
            out[name] = path, [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in PROMPTS]
    return out


@pytest.mark.parametrize("experts", sorted(EXPERTS))
@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_moe_groups_equal_tp1(moe_models, model, experts, tmp_path):
    path, tp1_outputs = moe_models[model]
    placed = ["--init-expert-location", placement_file(path, tmp_path)] if experts == "ep-gloo-placed" else []
    server = ServerProcess("--model-path", path, "--dtype", "float32", "--tp-size", "2", "--dp-size", "2",
                           "--enable-dp-attention", "--max-total-tokens", "2048", *EXPERTS[experts], *placed)
    try:
        server.wait_ready()
        results = post_to_groups(server, PROMPTS, GREEDY)  # both groups at once
        assert [r.json().get("output_ids") for r in results] == tp1_outputs, (results[0].text, server.log())
        # group 1 alone: group 0 idles through the experts' collectives
        r = server.post("/generate", {"input_ids": PROMPTS[2], "sampling_params": GREEDY, "routed_dp_rank": 1})
        assert r.json().get("output_ids") == tp1_outputs[2], (r.text, server.log())
        server.wait_idle_and_unleaked()
    finally:
        server.stop()
