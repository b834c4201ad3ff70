"""The native KV store (kernels/cpu_kv_store.c) writes exactly what kv_ops.store_kv writes, for
K/V given as strided views of a step's q|k|v rows and for both pool dtypes."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.kv_ops import store_kv

native = native_kernels()
pytestmark = pytest.mark.skipif(native is None, reason="needs a C compiler")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_store_matches_index_copy(dtype):
    heads, pages, page_size, dim, T = 3, 10, 4, 8, 7
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (5 + 2 * heads) * dim, generator=g).to(dtype)  # q | k | v rows of a step
    k = qkv[:, 5 * dim : (5 + heads) * dim].view(T, heads, dim)
    v = qkv[:, (5 + heads) * dim :].view(T, heads, dim)
    loc = torch.randperm(pages * page_size, generator=g)[:T]
    want_k, want_v = (torch.randn(heads, pages, page_size, dim, generator=g).to(dtype) for _ in range(2))
    got_k, got_v = want_k.clone(), want_v.clone()
    store_kv(want_k, want_v, loc, k, v)
    native.store_kv(got_k, got_v, loc, k, v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    native.store_kv(got_k, got_v, loc, k.reshape(T, -1), v.reshape(T, -1))  # the flat form too
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
