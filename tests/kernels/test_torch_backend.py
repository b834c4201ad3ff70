"""Torch attention backend and KV ops against a float64 reference over contiguous K/V.

Tolerances: float32 kernels vs float64 reference, atol 2e-5 / rtol 1e-4 (softmax
and matmul rounding of a few hundred terms); bfloat16 kernels, atol 3e-2
(8-bit mantissa on inputs and products).
"""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.attention.attention_backend import (ATTENTION_BACKENDS, AttentionBackend, attention_backend_names,
                                               create_attention_backend)
from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.kv_ops import gather_pages, slots_of, store_kv
from pdserve.engine.model_executor.attention.torch_backend import TorchAttentionBackend

torch.set_num_threads(1)
PAGE = 4


def reference(q, k_all, v_all, prefix: int) -> torch.Tensor:
    """Causal GQA attention in float64. q: [n, H, D]; k_all, v_all: [prefix + n, KVH, D] -> [n, H * D]."""
    n, heads, dim = q.shape
    group = heads // k_all.shape[1]
    k = k_all.double().repeat_interleave(group, dim=1)  # [S, H, D]
    v = v_all.double().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,shd->hns", q.double(), k) / dim**0.5
    allowed = torch.arange(k.shape[0])[None, :] <= (prefix + torch.arange(n))[:, None]  # [n, S]
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hns,shd->nhd", torch.softmax(s, -1), v).reshape(n, heads * dim)


def run_case(heads, kv_heads, seqs, dtype, seed=0, native=True, dim=16):
    """seqs: list of (prefix_len, extend_len). Prefix K/V is stored first, as a previous step would."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    pool = PagePool(64, PAGE, 1, kv_heads, dim, dtype)
    backend = TorchAttentionBackend(pool, heads, kv_heads, dim, dim**-0.5, use_native=native)
    assert (backend.native is not None) == native
    free = list(range(1, 64))
    rnd.shuffle(free)  # pages of a sequence are not contiguous, and not ascending
    pages, k_all, v_all = [], [], []
    for prefix, ext in seqs:
        n = prefix + ext
        pages.append([free.pop() for _ in range(pool.pages_for(n))])
        k_all.append(torch.randn(n, kv_heads, dim, generator=gen).to(dtype))
        v_all.append(torch.randn(n, kv_heads, dim, generator=gen).to(dtype))
        if prefix:
            loc = slots_of(torch.tensor(pages[-1]), prefix, PAGE)
            store_kv(pool.k[0], pool.v[0], loc, k_all[-1][:prefix], v_all[-1][:prefix])
    max_pages = max(len(p) for p in pages) + 1  # one column of padding, as a scheduler may leave
    page_table = torch.zeros(len(seqs), max_pages, dtype=torch.int32)
    for i, p in enumerate(pages):
        page_table[i, : len(p)] = torch.tensor(p)
    q = [torch.randn(ext, heads, dim, generator=gen).to(dtype) for _, ext in seqs]
    locs = [slots_of(page_table[i], pre + ext, PAGE)[pre:] for i, (pre, ext) in enumerate(seqs)]
    batch = ForwardBatch(
        input_ids=torch.zeros(sum(e for _, e in seqs), dtype=torch.int64),
        positions=torch.cat([torch.arange(pre, pre + ext) for pre, ext in seqs]),
        out_cache_loc=torch.cat(locs),
        page_table=page_table,
        logits_indices=torch.zeros(1, dtype=torch.int64),
        extend_lens=[e for _, e in seqs],
        seq_lens=[p + e for p, e in seqs],
    )
    backend.begin_forward(batch)
    new_k = torch.cat([k[pre:] for k, (pre, _) in zip(k_all, seqs)])
    new_v = torch.cat([v[pre:] for v, (pre, _) in zip(v_all, seqs)])
    out = backend.forward(torch.cat(q), new_k, new_v, 0)
    expected = torch.cat([reference(q[i], k_all[i], v_all[i], pre) for i, (pre, _) in enumerate(seqs)])
    # the new tokens' K/V landed in their slots
    for i, (pre, ext) in enumerate(seqs):
        all_slots = slots_of(page_table[i], pre + ext, PAGE)
        assert torch.equal(pool.k_slots(0)[all_slots], k_all[i])
        assert torch.equal(pool.v_slots(0)[all_slots], v_all[i])
    return out, expected


SHAPES = [(4, 2), (6, 1), (8, 8)]  # (heads, kv_heads): wide path for few KV heads, per-head path for 8
CASES = {
    "prefill_no_prefix": [(0, 5), (0, 17), (0, 2)],
    "prefill_prefix_spanning_pages": [(10, 7), (3, 1 + 8), (0, 6)],
    "decode_mixed_lengths": [(0, 1), (8, 1), (29, 1), (4, 1)],
    "mixed_decode_and_prefill": [(12, 1), (5, 9), (0, 1), (0, 13)],
}


def test_native_kernels_build_here():
    assert native_kernels() is not None  # this machine has a C compiler: the fast path must be tested


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("heads,kv_heads", SHAPES)
@pytest.mark.parametrize("case", list(CASES))
def test_float32_matches_float64_reference(heads, kv_heads, case, native):
    out, expected = run_case(heads, kv_heads, CASES[case], torch.float32, native=native)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_close_to_float64_reference(case, native):
    out, expected = run_case(6, 2, CASES[case], torch.bfloat16, seed=1, native=native)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dim", [64, 128])  # the native kernel has versions specialised for these
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_native_decode_specialised_head_dims(dim, dtype, atol):
    torch.set_num_threads(2)  # the kernel's OpenMP loop over (sequence, kv head) with more than one thread
    try:
        out, expected = run_case(6, 2, CASES["mixed_decode_and_prefill"], dtype, seed=2, dim=dim)
    finally:
        torch.set_num_threads(1)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=2e-2 if dtype == torch.bfloat16 else 1e-4)


def test_store_touches_only_its_slots_and_gather_returns_pages():
    pool = PagePool(8, PAGE, 1, 2, 4, torch.float32)
    loc = torch.tensor([5, 6, 13, 28])
    k = torch.arange(4 * 2 * 4, dtype=torch.float32).view(4, 2, 4) + 1
    store_kv(pool.k[0], pool.v[0], loc, k, -k)
    flat = pool.k_slots(0)
    assert torch.equal(flat[loc], k) and torch.equal(pool.v_slots(0)[loc], -k)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[loc] = False
    assert flat[untouched].abs().sum() == 0
    got = gather_pages(pool.k[0], torch.tensor([[1, 3], [7, 0]]))  # [2, 2 * PAGE, 2, 4]
    assert got.shape == (2, 2 * PAGE, 2, 4)
    assert torch.equal(got[0, 1], k[0]) and torch.equal(got[0, 2], k[1])  # slots 5, 6 = page 1
    assert torch.equal(got[1, 0], k[3])  # slot 28 = page 7 offset 0


def test_unknown_backend_is_a_value_error_naming_it():
    pool = PagePool(2, PAGE, 1, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="attention_backend.*'nope'"):
        create_attention_backend("nope", pool, 1, 1, 4, 0.5)
    assert attention_backend_names() == ["torch", "flashinfer"]
    with pytest.raises(ValueError, match="attention_backend must be one of \\['torch', 'flashinfer'\\], got 'nope'"):
        EngineConfig(attention_backend="nope")
    assert EngineConfig(attention_backend="flashinfer").attention_backend == "flashinfer"


def test_every_registered_backend_is_an_attention_backend():
    for name, target in ATTENTION_BACKENDS.items():  # flashinfer itself is imported only when built
        module, cls = target.split(":")
        assert issubclass(getattr(importlib.import_module(module), cls), AttentionBackend), name
