"""The native absorbed MLA decode kernel against its torch twin, on both of its paths (AVX-512
BF16 where the CPU has it, and the portable loops), in float32 and bf16, over ragged pages."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.mla_decode import MLADecodeKernel, mla_decode_torch

native = native_kernels()
pytestmark = pytest.mark.skipif(native is None, reason="no C compiler: the native kernels are not built")

R, DR, PAGE, PAGES = 64, 16, 4, 40


def case(dtype: torch.dtype, heads: int, lens: list[int], seed: int = 0, rank: int = R):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(1, PAGES, PAGE, rank + DR, generator=gen).to(dtype)
    n = len(lens)
    width = -(-max(lens) // PAGE)
    # each row's pages: a shuffled distinct set, padded with the scratch page 0
    perm = torch.randperm(PAGES - 1, generator=gen) + 1
    table = torch.zeros(n, width, dtype=torch.int32)
    at = 0
    for i, length in enumerate(lens):
        k = -(-length // PAGE)
        table[i, :k] = perm[at : at + k] if at + k <= PAGES - 1 else perm[:k]
        at += k
    q = torch.randn(n, heads, rank + DR, generator=gen).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads", [1, 6, 16])
def test_native_matches_torch_twin(portable, dtype, atol, heads):
    kernel = MLADecodeKernel(native, portable=portable)
    if portable:
        assert kernel.isa == "portable"
    q, cache, table, lens = case(dtype, heads, [1, 7, 33, 64])
    scale = (R + DR) ** -0.5 * 2
    got = kernel(q, cache, table, lens, R, scale)
    want = mla_decode_torch(q.float(), cache.float(), table, lens, R, scale)
    assert got.shape == (4, heads, R) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=0)


@pytest.mark.parametrize("rank", [40, 100])
def test_ranks_off_the_register_block(rank):
    """A latent rank that is not a multiple of the weighted sum's 64 columns (masked tails), odd
    tiles (token pairs with a lone last token) and a head count off the 4-head block."""
    kernel = MLADecodeKernel(native)
    q, cache, table, lens = case(torch.bfloat16, 7, [1, 31, 33, 70], rank=rank)
    scale = (rank + DR) ** -0.5
    got = kernel(q, cache, table, lens, rank, scale)
    want = mla_decode_torch(q.float(), cache.float(), table, lens, rank, scale)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=0)


def test_rows_attend_only_their_own_tokens():
    """A row's output moves when one of its own tokens changes, and not when another row's does."""
    kernel = MLADecodeKernel(native)
    q, cache, table, lens = case(torch.float32, 4, [5, 9])
    before = kernel(q, cache, table, lens, R, 0.1)
    p = int(table[1, 1])
    cache[0, p] += 1.0
    after = kernel(q, cache, table, lens, R, 0.1)
    assert torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1])


def test_bad_page_id_is_an_error_not_a_read():
    kernel = MLADecodeKernel(native)
    q, cache, table, lens = case(torch.float32, 2, [5])
    table[0, 0] = PAGES + 3
    with pytest.raises(ValueError, match="outside the pool"):
        kernel(q, cache, table, lens, R, 0.1)
