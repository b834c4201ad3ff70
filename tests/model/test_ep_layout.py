"""Expert-parallel layout without processes: the placement of experts on EP ranks, the split of a
TP group into EP ranks (SGLang's rule), the flags' checks, and that the EP ranks' partial sums
(remote experts' ids skipped) add up to the whole layer."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.layers import FusedMoE, KernelPlan, Step
from pdserve.engine.model_executor.layers.ep_placement import contiguous_placement
from pdserve.engine.model_executor.layers.moe_fused import moe_method
from pdserve.engine.model_executor import parallel
from pdserve.engine.model_executor.parallel import MoeParallel, head_shard, moe_parallel_for
from pdserve.engine.server_config import ServerConfig

HIDDEN, E, INTER, T, TOP_K = 32, 8, 16, 7, 3


def test_contiguous_placement_gives_each_rank_a_run():
    p = contiguous_placement(8, 4)
    assert [p.experts_of(r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert p.local_ids(1) == [-1, -1, 0, 1, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="ep_size 3 must divide the model's 8 routed experts"):
        contiguous_placement(8, 3)


def test_tp_group_splits_into_ep_ranks():
    assert moe_parallel_for(3, 4, 2, "none") == MoeParallel(2, 1, 2, 1, "none")
    assert moe_parallel_for(1, 2, 2, "gloo") == MoeParallel(2, 1, 1, 0, "gloo")
    assert moe_parallel_for(1, 2, 1, "gloo").a2a_backend == "none"  # EP 1 has nothing to exchange
    with pytest.raises(ValueError, match="ep_size 3 must divide tp_size 4"):
        moe_parallel_for(0, 4, 3, "none")
    with pytest.raises(ValueError, match="needs ep_size equal to tp_size"):
        moe_parallel_for(0, 4, 2, "gloo")


def test_flags_are_checked_before_any_rank_starts():
    with pytest.raises(ValueError, match="moe_a2a_backend must be one of"):
        EngineConfig(moe_a2a_backend="nccl")
    with pytest.raises(ValueError, match="ep_size must be >= 1"):
        EngineConfig(ep_size=0)
    with pytest.raises(ValueError, match="'deepep' runs on CUDA only"):
        EngineConfig(moe_a2a_backend="deepep")
    with pytest.raises(ValueError, match="ep_size 2 must divide tp_size 3"):
        ServerConfig(engine=EngineConfig(ep_size=2), tp_size=3)


def test_ep_ranks_partial_sums_make_the_whole_layer(monkeypatch):
    plan = KernelPlan.choose(torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    w1, w3 = (torch.randn(E, INTER, HIDDEN, generator=g) / HIDDEN ** 0.5 for _ in range(2))
    w2 = torch.randn(E, HIDDEN, INTER, generator=g) / INTER ** 0.5
    x, logits = torch.randn(T, HIDDEN, generator=g), torch.randn(T, E, generator=g)

    def layer(rank: int, size: int, ep: MoeParallel) -> FusedMoE:
        monkeypatch.setattr(parallel, "_MOE", ep)
        moe = FusedMoE(plan, E, TOP_K, HIDDEN, INTER, head_shard(rank, size, 2, 2), method=moe_method(plan, E))
        for e in range(E):
            for shard, w in (("w1", w1), ("w3", w3), ("w2", w2)):
                moe.weight_loader("weight", w[e], shard, e)
        moe.process_weights()
        return moe

    want = layer(0, 1, MoeParallel()).forward(x, logits, Step(T, False))
    got = torch.zeros(T, HIDDEN)
    for rank in range(2):  # not joined by a group: the test adds what the all-reduce would
        moe = layer(rank, 2, moe_parallel_for(rank, 2, 2, "none"))
        assert moe.local_experts == list(range(rank * 4, rank * 4 + 4))
        assert torch.equal(moe.read_back("weight", "w3", rank * 4 + 1), w3[rank * 4 + 1])  # whole rows
        with pytest.raises(ValueError, match=f"held by EP rank {1 - rank}"):
            moe.read_back("weight", "w1", (1 - rank) * 4)
        got += moe.forward(x, logits, Step(T, False))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
