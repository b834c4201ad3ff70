"""The native bf16 kernels: causal prefill attention against a float64 reference and PyTorch's own
bf16 SDPA; fused RMSNorm and rope against the torch ops they replace.

Tolerance: bf16 output carries one rounding (~4e-3 relative) plus bf16 products;
the kernel's max error vs float64 must stay within 1.25x PyTorch's bf16 flash
attention's error on the same inputs (+1e-3), and under 4e-2 absolute.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels.cpu_native import native_kernels

NATIVE = native_kernels()
pytestmark = pytest.mark.skipif(
    NATIVE is None or not NATIVE.has_prefill, reason="needs a C compiler and a CPU with AVX-512 BF16"
)


def reference(q, k, v, scale):
    """q: [n, H, D]; k, v: [Lk, KVH, D]; query i sees keys 0 .. Lk - n + i. float64 [n, H * D]."""
    n, heads, dim = q.shape
    keys, group = k.shape[0], heads // k.shape[1]
    kf, vf = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kf) * scale
    allowed = torch.arange(keys)[None, :] <= (keys - n + torch.arange(n))[:, None]
    p = s.masked_fill(~allowed[None], float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", p, vf).reshape(n, heads * dim)


def torch_bf16(q, k, v, scale):
    n, keys = q.shape[0], k.shape[0]
    allowed = torch.arange(keys)[None, :] <= (keys - n + torch.arange(n))[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=allowed, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1).reshape(n, -1)


# (new tokens, cached prefix): one block, ragged edges of the 4-row groups, 32-token items and
# 64-key blocks, a prefix longer than the new part
SIZES = [(2, 0), (5, 0), (33, 0), (64, 0), (100, 7), (129, 64), (513, 0), (3, 1000), (40, 300)]


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("n,prefix", SIZES)
def test_matches_reference_as_closely_as_torch(dim, heads, kv_heads, n, prefix):
    gen = torch.Generator().manual_seed(n * 7 + prefix)
    keys = n + prefix
    # q, k, v as the model hands them over: views into one fused row per token (strided tokens)
    qkv = (torch.randn(keys, heads + 2 * kv_heads, dim, generator=gen) * 2).bfloat16()
    q, k, v = qkv[prefix:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    scale = dim**-0.5
    out = torch.full((n, heads * dim), float("nan"), dtype=torch.bfloat16)
    torch.set_num_threads(2)  # items are shared between OpenMP threads
    try:
        NATIVE.prefill_attention(q, k, v, out, scale)
    finally:
        torch.set_num_threads(1)
    expected = reference(q, k, v, scale)
    err = (out.double() - expected).abs().max().item()
    torch_err = (torch_bf16(q, k, v, scale).double() - expected).abs().max().item()
    assert err <= 1.25 * torch_err + 1e-3 and err < 4e-2, (err, torch_err)


@pytest.mark.parametrize("n,prefix", [(5, 0), (40, 300)])
def test_keys_read_in_place_from_their_slots_are_the_contiguous_keys(n, prefix):
    """``key_rows``: each key from its slot of a pool (a cached prefix's pages), the same result
    bit for bit as the same keys passed in order (the attention backend's path with a prefix)."""
    heads, kv_heads, dim, slots = 9, 3, 64, 1024
    gen = torch.Generator().manual_seed(n + prefix)
    q = torch.randn(n, heads, dim, generator=gen).bfloat16()
    pool_k, pool_v = (torch.randn(slots, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
    rows = torch.randperm(slots, generator=gen)[: n + prefix]
    in_place, in_order = (torch.empty(n, heads * dim, dtype=torch.bfloat16) for _ in range(2))
    NATIVE.prefill_attention(q, pool_k, pool_v, in_place, dim**-0.5, key_rows=rows)
    NATIVE.prefill_attention(q, pool_k[rows], pool_v[rows], in_order, dim**-0.5)
    assert torch.equal(in_place, in_order)


def test_writes_only_its_rows_of_a_strided_output():
    heads, kv_heads, dim, n = 4, 2, 64, 10
    qkv = torch.randn(n, heads + 2 * kv_heads, dim).bfloat16()
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    big = torch.zeros(3 * n, heads * dim, dtype=torch.bfloat16)
    NATIVE.prefill_attention(q, k, v, big[n : 2 * n], dim**-0.5)
    assert big[:n].abs().sum() == 0 and big[2 * n :].abs().sum() == 0
    torch.testing.assert_close(big[n : 2 * n].double(), reference(q, k, v, dim**-0.5), atol=3e-2, rtol=2e-2)


def test_unsupported_head_dim_is_refused():
    assert not NATIVE.supports_prefill(torch.bfloat16, 96) and not NATIVE.supports_prefill(torch.float32, 64)


def test_fused_norm_and_rope_match_the_torch_ops_bit_for_bit():
    from pdserve.engine.model_executor.layers.norm import rms_norm as _rms_norm

    gen = torch.Generator().manual_seed(3)
    rows = (torch.randn(37, 700, generator=gen) * 3).bfloat16()[:, 50:626]  # strided rows, as from a fused matmul
    weight = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    assert torch.equal(NATIVE.rms_norm(rows, weight, 1e-5), _rms_norm(rows, weight, 1e-5))
    qkv = (torch.randn(37, 15, 64, generator=gen) * 2).bfloat16()
    qk = qkv[:, :12]
    positions = torch.randint(0, 4000, (37,), generator=gen)
    angles = torch.outer(torch.arange(4096).float(), 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = torch.cat([angles, angles], -1).cos().bfloat16(), torch.cat([angles, angles], -1).sin().bfloat16()
    c, s = cos.index_select(0, positions)[:, None], sin.index_select(0, positions)[:, None]
    expected = qk * c + torch.cat([-qk[..., 32:], qk[..., :32]], dim=-1) * s
    assert torch.equal(NATIVE.rope(qk, cos, sin, positions), expected)
