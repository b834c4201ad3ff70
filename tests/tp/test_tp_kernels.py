"""The attention kernels on a TP rank's head counts: few query heads over one KV head.

TP 3 of the default model leaves each rank 3 heads and 1 KV head; TP 2 and TP 4 of the tiny
checkpoints 2 / 1 and 1 / 1; TP 2 of an 8 / 2 model 4 / 1. The native decode and prefill
kernels (bf16 prefill: head dim 64) must take them as well as the torch path.
"""

from __future__ import annotations

import pytest
import torch
from test_torch_backend import CASES, run_case


@pytest.mark.parametrize("heads,kv_heads", [(3, 1), (2, 1), (1, 1), (4, 1)])
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 2e-5, 1e-4), (torch.bfloat16, 3e-2, 2e-2)])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_rank_local_head_counts(heads, kv_heads, dtype, atol, rtol, native):
    for case in CASES.values():
        out, expected = run_case(heads, kv_heads, case, dtype, native=native, dim=64)
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)
