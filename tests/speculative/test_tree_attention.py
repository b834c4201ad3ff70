"""A draft tree's attention in the torch backend: the native bf16 kernel, taken one branch segment
at a time, equals the masked SDPA path (which the tiny-checkpoint test checks against each path
alone), on this CPU where the native kernel runs."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.model_executor.attention.torch_backend import TorchAttentionBackend


@pytest.mark.parametrize("parents", [[-1, 0, -1, 1, 0, 4, -1], [-1, -1, -1], [-1, 0, 1, 1, 0]])
def test_native_segments_equal_the_masked_sdpa_rows(parents):
    pool = PagePool(12, 4, num_layers=1, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    native = TorchAttentionBackend(pool, 4, 2, 64, 0.125)
    if not native.native_prefill:
        pytest.skip("the native bf16 prefill kernel does not run on this CPU")
    sdpa = TorchAttentionBackend(pool, 4, 2, 64, 0.125, use_native=False)
    gen = torch.Generator().manual_seed(0)
    prefix, n = 9, len(parents)
    pages = [3, 7, 1, 9, 5]
    slot = lambda p: pages[p // 4] * 4 + p % 4  # noqa: E731
    pool.k_slots(0)[[slot(p) for p in range(prefix)]] = torch.randn(prefix, 2, 64, generator=gen).bfloat16()
    pool.v_slots(0)[[slot(p) for p in range(prefix)]] = torch.randn(prefix, 2, 64, generator=gen).bfloat16()
    q = torch.randn(1 + n, 4, 64, generator=gen).bfloat16()
    k = torch.randn(1 + n, 2, 64, generator=gen).bfloat16()
    v = torch.randn(1 + n, 2, 64, generator=gen).bfloat16()
    # a plain decode row of another sequence in the same batch, before the tree
    fb = ForwardBatch(torch.zeros(2 + n, dtype=torch.int64), torch.zeros(2 + n, dtype=torch.int64),
                      torch.tensor([slot(0)] + [slot(p) for p in range(prefix, prefix + 1 + n)]),
                      torch.tensor([pages, pages], dtype=torch.int32), torch.arange(2 + n), [1, 1 + n],
                      [1, prefix + 1 + n], tree_parents=[None, parents])
    q2, k2, v2 = (torch.cat([x[:1], x]) for x in (q, k, v))
    k2[0], v2[0] = pool.k_slots(0)[slot(0)], pool.v_slots(0)[slot(0)]  # the decode row rewrites slot 0 as it is
    outs = []
    for backend in (native, sdpa):
        backend.begin_forward(fb)
        outs.append(backend.forward(q2, k2, v2, 0).float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    assert len(native.prefills) == 1 + sum(p != j - 1 for j, p in enumerate(parents) if j)  # one call per segment
