"""Speculative decoding under DP attention: ``--tp-size 2 --dp-size 2 --enable-dp-attention``, fp32.

- NGRAM on the tiny Llama: the verify step is a target forward of one row per fed token and
  draft, every row sampled, so each group announces its own verify rows in its rounds and the
  groups' accept lengths differ freely;
- STANDALONE on a tiny Llama of six layers, all but the last silenced, drafted by a one-layer
  Llama of that last layer (so it guesses well and costs a fraction of a target step): the draft's
  steps are draft rounds, which a group verifying or idle answers with the draft's idle forward;
- NEXTN on a tiny DeepSeek-V3 of six layers, all but the last silenced, whose MTP layer (routed
  and shared experts) copies that last layer: its steps are draft rounds, answered with the MTP's
  idle forward;
- each: greedy output equals TP 1 without speculation with a batch over both groups and with one
  group working while the other idles; drafts are accepted in each group; the pools end unleaked;
- the round's kind, pure: the target's first, a group of another kind counts no rows;
- NEXTN in PD is served too (``test_dp_attention_spec_pd.py``).

One server per algorithm: on a shared 2-core machine each stand is slow, so each test asks
everything of its one stand.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file
from server_helpers import ServerProcess, post_to_groups
from support.deepseek_util import add_mtp_layer, make_deepseek_checkpoint
from test_dp_attention_groups import dispatched, tp1_outputs
from test_tp_server import PROMPTS

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.dp_attention import DRAFT, TARGET, round_kind, round_rows
from pdserve.engine.server_config import ServerConfig

pytestmark = pytest.mark.timeout(600)

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
DP = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--dtype", "float32", "--max-total-tokens", "2048")


def check_spec_equals_tp1(path: str, *flags: str) -> list[int]:
    """A DP-attention server on ``path`` speculating with ``flags``: a batch over both groups, then
    each group alone, greedy equal to TP 1 without speculation; pools unleaked. Returns the drafts
    each request accepted: the batch's (prompt i in group i % 2), then the repetitive prompt's in
    group 0 alone and in group 1 alone."""
    want = tp1_outputs(path, GREEDY)
    server = ServerProcess("--model-path", path, *DP, *flags)
    try:
        server.wait_ready()
        results = post_to_groups(server, PROMPTS, GREEDY)  # both groups at once
        assert [r.json().get("output_ids") for r in results] == want, (results[0].text, server.log())
        metas = [r.json()["meta_info"] for r in results]
        for rank in (0, 1):  # one group speculates, the other idles through its rounds
            before = dispatched(server)
            r = server.post("/generate", {"input_ids": PROMPTS[2], "sampling_params": GREEDY,
                                          "routed_dp_rank": rank})
            assert r.json().get("output_ids") == want[2], (r.text, server.log())
            metas.append(r.json()["meta_info"])
            after = dispatched(server)
            assert after[str(rank)] == before.get(str(rank), 0) + 1
            assert after.get(str(1 - rank), 0) == before.get(str(1 - rank), 0)
        server.wait_idle_and_unleaked()
    finally:
        server.stop()
    return [m.get("spec_accept_token_num", 0) for m in metas]


def test_ngram_equals_tp1(tiny_checkpoints):
    accepted = check_spec_equals_tp1(tiny_checkpoints["llama"], "--speculative-algorithm", "NGRAM")
    assert sum(accepted[:len(PROMPTS)]) > 0 and all(a > 0 for a in accepted[len(PROMPTS):]), accepted


LAYERS = 6  # the target's: a draft step costs a fraction of a target step, so drafts pay


def silence_layers_before_last(path: str) -> None:
    """Zero the attention and MLP outputs of every layer of the checkpoint at ``path`` but the last
    (each then passes its input on), so the target computes what its last layer alone would, and
    a draft of that layer guesses its greedy tokens while the target still runs all its layers'
    collectives."""
    weights = load_file(os.path.join(path, "model.safetensors"))
    for name, w in weights.items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) < LAYERS - 1 and name.endswith(
                ("o_proj.weight", "down_proj.weight")):
            w.zero_()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def relayer(src: str, dst: str, layers: list[int]) -> None:
    """A copy at ``dst`` of the checkpoint at ``src`` whose layer i is ``src``'s ``layers[i]``."""
    shutil.copytree(src, dst)
    weights = load_file(os.path.join(src, "model.safetensors"))
    out = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    for i, j in enumerate(layers):
        prefix = f"model.layers.{j}."
        out.update({f"model.layers.{i}.{k[len(prefix):]}": v.clone() for k, v in weights.items()
                    if k.startswith(prefix)})
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = len(layers)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)


def test_standalone_equals_tp1(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama"]
    last = json.load(open(os.path.join(src, "config.json")))["num_hidden_layers"] - 1
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    relayer(src, target, [0] * (LAYERS - 1) + [last])
    silence_layers_before_last(target)
    relayer(src, draft, [last])
    accepted = check_spec_equals_tp1(target, "--speculative-algorithm", "STANDALONE",
                                     "--speculative-draft-model-path", draft)
    assert sum(accepted[:len(PROMPTS)]) > 0 and all(a > 0 for a in accepted[len(PROMPTS):]), accepted


def test_nextn_equals_tp1(tmp_path):
    path = str(tmp_path)
    make_deepseek_checkpoint("v3", path, num_hidden_layers=LAYERS)
    silence_layers_before_last(path)
    add_mtp_layer(path, copy_last=True)
    accepted = check_spec_equals_tp1(path, "--speculative-algorithm", "NEXTN")
    assert sum(accepted[:len(PROMPTS)]) > 0 and all(a > 0 for a in accepted[len(PROMPTS):]), accepted


def test_round_kind_takes_the_target_first():
    # (running, kind, rows, sampled) per group
    assert round_kind([[1, DRAFT, 4, 2], [1, TARGET, 6, 6]]) == TARGET
    assert round_rows([[1, DRAFT, 4, 2], [1, TARGET, 6, 6]], TARGET) == ([0, 6], [0, 6])
    assert round_kind([[1, DRAFT, 4, 2], [0, TARGET, 0, 0]]) == DRAFT  # a finished group answers a draft round
    assert round_rows([[1, DRAFT, 4, 2], [0, TARGET, 0, 0]], DRAFT) == ([4, 0], [2, 0])
    assert round_kind([[1, DRAFT, 3, 3], [1, DRAFT, 5, 1]]) == DRAFT
    assert round_rows([[1, DRAFT, 3, 3], [1, DRAFT, 5, 1]], DRAFT) == ([3, 5], [3, 1])
    assert round_kind([[0, TARGET, 0, 0], [0, TARGET, 0, 0]]) is None  # every group is done


def test_what_dp_attention_speculates_with():
    def config(algorithm: str, mode: str = "null") -> ServerConfig:
        return ServerConfig(EngineConfig(speculative_algorithm=algorithm), tp_size=2, dp_size=2,
                            enable_dp_attention=True, disaggregation_mode=mode)

    assert config("NGRAM").engine.speculative_algorithm == "NGRAM"
    assert config("NGRAM", "decode").engine.speculative_algorithm == "NGRAM"
    assert config("NEXTN").engine.speculative_algorithm == "NEXTN"
    assert config("STANDALONE").engine.speculative_algorithm == "STANDALONE"
    for mode in ("prefill", "decode"):  # the prefill's prompt MTP runs draft rounds (test_dp_attention_spec_pd.py)
        assert config("NEXTN", mode).engine.speculative_algorithm == "NEXTN"
