"""The fused expert method (``layers/moe_fused.py``) inside ``FusedMoE``: the experts sharded over
two TP ranks by intermediate rows sum to the per-expert method's output on the whole experts, in
float32 and bf16; quantized plans keep the per-expert method."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.model_executor.layers import FusedMoE, KernelPlan, PerExpertMoEMethod, Step
from pdserve.engine.model_executor.layers.moe_fused import FusedMoEMethod, moe_method
from pdserve.engine.model_executor.parallel import head_shard

HIDDEN, E, INTER, T, TOP_K = 64, 6, 32, 9, 3


def _moe(plan: KernelPlan, rank: int, tp_size: int, weights, method) -> FusedMoE:
    w1, w3, w2 = weights
    moe = FusedMoE(plan, E, TOP_K, HIDDEN, INTER, head_shard(rank, tp_size, 2, 2), method=method)
    moe.tp_size = 1  # the ranks' partial sums are added by the test instead of all-reduced
    for e in range(E):
        for shard, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            moe.weight_loader("weight", w[e], shard, e)
    moe.process_weights()
    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_shards_sum_to_the_per_expert_whole(dtype):
    plan = KernelPlan.choose(dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    weights = [(torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(dtype)
               for shape in ((E, INTER, HIDDEN), (E, INTER, HIDDEN), (E, HIDDEN, INTER))]
    x, logits = torch.randn(T, HIDDEN, generator=g).to(dtype), torch.randn(T, E, generator=g)
    want = _moe(plan, 0, 1, weights, PerExpertMoEMethod(plan, E)).forward(x, logits, Step(T, False)).float()
    got = torch.zeros(T, HIDDEN)
    for rank in range(2):
        moe = _moe(plan, rank, 2, weights, moe_method(plan, E))
        assert isinstance(moe.method, FusedMoEMethod)
        assert torch.equal(moe.method.dense(2, "w3"), weights[1][2, rank * 16:(rank + 1) * 16].float())
        got += moe.forward(x, logits, Step(T, False)).float()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_quantized_plans_keep_the_per_expert_method():
    plan = KernelPlan.choose(torch.bfloat16, torch.device("cpu"), "w8a16")
    assert type(moe_method(plan, E)) is PerExpertMoEMethod
