"""The native greedy pick (kernels/cpu_argmax.c) against torch.argmax: the same index for every
row, including ties (the first), NaNs (the first NaN), infinities and strided rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.sampling import greedy_ids

native = native_kernels()
pytestmark = pytest.mark.skipif(native is None, reason="needs a C compiler")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(64, 49152), (1, 49152), (7, 33), (3, 1)])
def test_argmax_is_torchs(shape, threads):
    torch.set_num_threads(threads)
    m, v = shape
    g = torch.Generator().manual_seed(m * 7 + v)
    wide = torch.randn(m, v + 5, generator=g)
    x = wide[:, 2 : v + 2]  # rows at a stride of their own
    if v > 1:
        for r in range(0, m, 3):  # ties: the maximum again, later in the row
            at = int(x[r].argmax())
            x[r, (at + 1 + r) % v] = x[r, at]
        special = [float("nan"), float("inf"), float("-inf")]
        for i, r in enumerate(range(1, m, 3)):  # a NaN before or after an infinity, or two NaNs
            x[r, (5 * r) % v] = special[i % 3]
            x[r, (5 * r + 3) % v] = special[(i + 1) % 3] if i % 4 != 3 else float("nan")
    if m > 2:
        x[2] = float("-inf")  # a row of -inf: index 0
    got = native.argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
    assert torch.equal(greedy_ids(x), x.argmax(-1))


def test_greedy_ids_falls_back_to_torch():
    x = torch.randn(5, 40)
    assert torch.equal(greedy_ids(x.t()), x.t().argmax(-1))  # columns contiguous, not rows
    assert torch.equal(greedy_ids(x.bfloat16()), x.bfloat16().argmax(-1))
