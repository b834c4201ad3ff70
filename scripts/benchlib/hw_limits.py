"""This machine's limits, measured in the benchmark's own run, and a model step's cost against them.

A figure divided by its limit means the same on any CPU and under any load that hits the
figure and the limit alike (the limits are measured in the same process, just before):

- read bandwidth: the best GB/s of a ``torch.sum`` over a large bf16 tensor (512 MB by default,
  far past the caches), the rate at which a decode step at batch 1 can stream its weights;
- GEMM peak: the best bf16 GFLOP/s of an n^3 product (plain ``torch.mm`` or a prepacked oneDNN
  linear, what pdserve's linears use), the rate prefill and a large decode batch can reach.

A decode step at batch 1 reads every linear weight once (the embedding lookup reads one row),
so its floor is weight bytes / bandwidth. A step of T tokens does 2 T x params FLOPs in its
linears plus its attention's, so its floor is FLOPs / GEMM peak.
"""

from __future__ import annotations

import time

import torch


def read_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Best GB/s of a sum over ``mbytes`` MB of bf16: memory read bandwidth with this torch's threads."""
    x = torch.ones(mbytes * 2**20 // 2, dtype=torch.bfloat16)
    x.sum()  # first touch
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best / 1e9


def gemm_rate(n: int = 4096, repeats: int = 3, dtype: torch.dtype = torch.bfloat16) -> float:
    """Best GFLOP/s of an n^3 product in ``dtype``, plain ``torch.mm`` or, for bf16, a prepacked
    oneDNN linear (what pdserve's linears use; transformers' go through the same oneDNN) where
    the CPU has the instructions oneDNN's bf16 prepacking needs."""
    a, w = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    calls = [lambda: torch.mm(a, w)]
    if dtype == torch.bfloat16 and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, n)
        except RuntimeError:  # e.g. AVX2 only: "bf16 path needs avx_ne_convert or avx512bw, ..."
            pass
        else:
            calls.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for call in calls:
        call()
        for _ in range(repeats):
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def linear_params(arch) -> int:
    """Weights a decode step multiplies by: q|k|v, o, gate|up, down of every layer, and the LM head."""
    hidden, inter, dim = arch.hidden_size, arch.intermediate_size, arch.head_dim
    per_layer = hidden * (arch.num_heads + 2 * arch.num_kv_heads) * dim + arch.num_heads * dim * hidden
    per_layer += 3 * hidden * inter
    return per_layer * arch.num_layers + arch.vocab_size * hidden


def step_flops(arch, new_tokens: int, context: int, sampled: int) -> float:
    """FLOPs of one step for one sequence: ``new_tokens`` through the layers after ``context``
    cached ones, ``sampled`` rows through the LM head, causal attention (QK^T and PV)."""
    hidden, dim = arch.hidden_size, arch.head_dim
    layer_params = (linear_params(arch) - arch.vocab_size * hidden) // arch.num_layers
    linear = 2 * new_tokens * layer_params * arch.num_layers + 2 * sampled * arch.vocab_size * hidden
    # each new token attends to the context plus the new tokens before it (and itself)
    attended = new_tokens * context + new_tokens * (new_tokens + 1) / 2
    attention = 4 * arch.num_heads * dim * attended * arch.num_layers
    return linear + attention
