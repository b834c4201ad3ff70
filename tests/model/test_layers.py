"""The layers' own logic on plain float32 tensors: tensor-parallel slicing and fusion through
weight loaders, the registry, Q8_0 all-or-none, and the reference expert layer against a loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.model_executor.layers import (FusedMoE, KernelPlan, MergedColumnParallelLinear, QKVParallelLinear,
                                                  RowParallelLinear, Step)
from pdserve.engine.model_executor.layers.vocab import ParallelLMHead
from pdserve.engine.model_executor.models.llama import LlamaForCausalLM
from pdserve.engine.model_executor.models.registry import model_class, register_model
from pdserve.engine.model_executor.parallel import head_shard

PLAN = KernelPlan.choose(torch.float32, torch.device("cpu"))  # the plain torch path: no packing
HIDDEN, D = 32, 8


def test_qkv_rows_per_rank_split_and_replicated():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * D, HIDDEN, generator=g) for n in (4, 2, 2))
    for tp_size in (1, 2, 4):  # 4 ranks: the 2 KV heads replicated, one per pair of ranks
        for rank in range(tp_size):
            tp = head_shard(rank, tp_size, 4, 2)
            layer = QKVParallelLinear(PLAN, HIDDEN, D, tp)
            for shard, w in zip("qkv", (q, k, v)):
                layer.weight_loader("weight", w, shard)
            layer.process_weights()
            H, KVH = tp.num_heads, tp.num_kv_heads
            want_q = q[tp.q_start * D:(tp.q_start + H) * D]
            want_k = k[tp.kv_start * D:(tp.kv_start + KVH) * D]
            assert torch.equal(layer.read_back("weight", "q"), want_q)
            assert torch.equal(layer.read_back("weight", "k"), want_k)
            want_v = v[tp.kv_start * D:(tp.kv_start + KVH) * D]
            assert torch.equal(layer.method.large, torch.cat([want_q, want_k, want_v]))


def test_mlp_shards_sum_to_the_whole_mlp():
    g = torch.Generator().manual_seed(1)
    inter = 16
    gate, up, down = torch.randn(inter, HIDDEN, generator=g), torch.randn(inter, HIDDEN, generator=g), \
        torch.randn(HIDDEN, inter, generator=g)
    x = torch.randn(3, HIDDEN, generator=g)
    want = F.linear(F.silu(x @ gate.T) * (x @ up.T), down)
    got = torch.zeros_like(want)
    for rank in range(2):
        tp = head_shard(rank, 2, 2, 2)
        gate_up = MergedColumnParallelLinear(PLAN, HIDDEN, inter, tp, ("gate", "up"), swiglu=True)
        gate_up.weight_loader("weight", gate, "gate")
        gate_up.weight_loader("weight", up, "up")
        down_p = RowParallelLinear(PLAN, inter, HIDDEN, tp)
        down_p.tp_size = 1  # the two ranks' partial sums are added here instead of all-reduced
        down_p.weight_loader("weight", down)
        for layer in (gate_up, down_p):
            layer.process_weights()
        step = Step(3, False)
        got += down_p.forward(gate_up.forward(x, step), step)
    torch.testing.assert_close(got, want)


def test_missing_part_is_named():
    layer = QKVParallelLinear(PLAN, HIDDEN, D, head_shard(0, 1, 4, 2))
    layer.weight_loader("weight", torch.zeros(4 * D, HIDDEN), "q")
    with pytest.raises(ValueError, match="weight:k"):
        layer.check_loaded("model.layers.0.self_attn.qkv_proj")


def test_lm_head_pads_the_last_vocabulary_shard():
    head = ParallelLMHead(PLAN, 10, HIDDEN, head_shard(1, 4, 4, 4))  # shards of 3 rows: rank 1 holds 3..5
    w = torch.randn(10, HIDDEN)
    head.weight_loader("weight", w)
    head.process_weights()
    assert torch.equal(head.read_back(), w[3:6])
    last = ParallelLMHead(PLAN, 10, HIDDEN, head_shard(3, 4, 4, 4))  # rank 3: row 9 and two zero rows
    last.weight_loader("weight", w)
    last.process_weights()
    assert last.method.large.shape == (3, HIDDEN) and torch.equal(last.read_back(), w[9:])


def test_registry_serves_the_llama_family_and_refuses_others():
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert model_class(name) is LlamaForCausalLM
    with pytest.raises(ValueError, match="'NoSuchForCausalLM' is not supported"):
        model_class("NoSuchForCausalLM")
    with pytest.raises(ValueError, match="already registered"):
        register_model("LlamaForCausalLM")(type("Other", (LlamaForCausalLM,), {}))


def test_per_expert_moe_matches_a_loop_and_shards_sum():
    g = torch.Generator().manual_seed(2)
    E, inter, T, top_k = 4, 16, 5, 2
    w1, w3 = torch.randn(E, inter, HIDDEN, generator=g), torch.randn(E, inter, HIDDEN, generator=g)
    w2 = torch.randn(E, HIDDEN, inter, generator=g)
    x, logits = torch.randn(T, HIDDEN, generator=g), torch.randn(T, E, generator=g)
    probs = logits.softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    want = torch.zeros(T, HIDDEN)
    for t in range(T):
        for j in range(top_k):
            e = int(ids[t, j])
            want[t] += weights[t, j] * (F.silu(x[t] @ w1[e].T) * (x[t] @ w3[e].T)) @ w2[e].T
    got = torch.zeros(T, HIDDEN)
    for rank in range(2):
        moe = FusedMoE(PLAN, E, top_k, HIDDEN, inter, head_shard(rank, 2, 2, 2))
        moe.tp_size = 1  # the two ranks' partial sums are added here instead of all-reduced
        for e in range(E):
            for shard, w in (("w1", w1), ("w3", w3), ("w2", w2)):
                moe.weight_loader("weight", w[e], shard, e)
        moe.process_weights()
        assert torch.equal(moe.method.dense(1, "w3"), w3[1, rank * 8:(rank + 1) * 8])
        got += moe.forward(x, logits, Step(T, False))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_expert_names_map_to_their_layer_shard_and_expert():
    from pdserve.engine.model_executor.layers.moe import expert_weight_name

    assert expert_weight_name("model.layers.3.mlp.experts.7.up_proj.weight") == ("model.layers.3.mlp.experts.weight",
                                                                                 "w3", 7)
    assert expert_weight_name("model.layers.0.block_sparse_moe.experts.1.w2.weight")[1:] == ("w2", 1)
    assert expert_weight_name("model.layers.3.mlp.gate_proj.weight") is None
