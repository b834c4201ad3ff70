"""The weight layout native gemv (``cpu_gemv.c``) streams, packed once at load. Pure torch.

Why packed: at one token a decode step is a stream over the weights, and gemv multiplies 4
rows at a time. Read row-major, those are 4 interleaved streams of 18 cache lines each (K =
576 bf16), which the hardware prefetcher follows poorly: 21 GB/s over the default model's
121 products where a plain read of the same bytes does 28 (one Zen 4 core). Stored so that
each block of 4 rows is one run of memory, in the order the kernel reads it, the whole model
is one sequential stream and reads at the plain read's rate (microbenchmark in the same
process: 28-30 GB/s). 2 MB pages (madvise), non-temporal loads and software prefetch at any
distance changed nothing on either layout.

Layout: the output rows (``rows / 2`` of them for SwiGLU's gate | up) in blocks of 4, the
last padded with zero rows; each block is its ``ceil(cols / 32)`` chunks of 32 columns in
order (zero-padded), each chunk its 4 rows' 32 values. For SwiGLU, block b's gate chunks then
its up chunks, so gate and up stay one stream. Flat: ``[blocks, halves, chunks, 4, 32]``.
The sums are the row-major kernel's exactly (the same 32-wide chunks in the same order; the
padding adds zero products).

int8 weights (two's complement) are stored, within each chunk, as rows (0, 1) and (2, 3) in two
64-byte pairs interleaved 8 by 8 (``[pair, 4, row of pair, 8]``): the kernels sign-extend them to
int16 straight from memory (16 or 32 at a time) and multiply them in integers against x in fixed
point, whose 8-column groups they store twice so that one vector of x meets both rows of a pair
(AVX2 ``vpmaddwd``, AVX-512 VNNI ``vpdpwssd``). An earlier AVX-512 kernel stored sign-magnitude and
widened int8 to bf16 by byte lookups; the integer products are faster (README, "Decode step").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS = 4  # rows per block (RB in cpu_gemv.c)
CHUNK = 32  # columns per chunk: one AVX-512 vector of bf16


def _geometry(rows: int, cols: int, swiglu: bool) -> tuple[int, int, int, int]:
    """(halves, output rows, blocks, chunks) of a [rows, cols] weight packed as ``swiglu`` says."""
    halves, rows_out = (2, rows // 2) if swiglu else (1, rows)
    return halves, rows_out, -(-rows_out // ROWS), -(-cols // CHUNK)


@dataclass(frozen=True)
class GemvWeight:
    """A weight [rows, cols] packed for native gemv; int8 with a float32 ``scale`` per row
    (row n is ``q[n] * scale[n]``). ``swiglu``: rows are gate | up, multiplied as SwiGLU."""

    data: torch.Tensor  # flat, packed: bf16 or int8
    rows: int
    cols: int
    swiglu: bool
    # int8 only, float32: [rows], or [rows, ceil(cols / 32)] for Q8_0's block scales (``blocked``:
    # one per row and chunk)
    scale: torch.Tensor | None = None

    @property
    def blocked(self) -> bool:
        return self.scale is not None and self.scale.dim() == 2

    @classmethod
    def pack(cls, w: torch.Tensor, swiglu: bool = False, scale: torch.Tensor | None = None) -> "GemvWeight":
        """``w`` [N, K], bf16, or int8 with ``scale`` [N] float32, or [N, K / 32] (Q8_0: K a
        multiple of 32)."""
        n, k = w.shape
        int8 = w.dtype == torch.int8
        assert w.dtype in (torch.bfloat16, torch.int8) and (scale is not None) == int8
        assert not swiglu or n % 2 == 0
        if int8:
            assert scale.dtype == torch.float32 and (scale.shape == (n,) or (scale.shape == (n, k // CHUNK)
                                                                             and k % CHUNK == 0))
        halves, rows_out, blocks, chunks = _geometry(n, k, swiglu)
        padded = w.new_zeros(halves, blocks * ROWS, chunks * CHUNK)
        padded[:, :rows_out, :k] = w.reshape(halves, rows_out, k)
        if int8:  # [h, b, pair, row of pair, c, 4, 8] -> [b, h, c, pair, 4, row of pair, 8]
            data = padded.view(halves, blocks, 2, 2, chunks, 4, 8).permute(1, 0, 4, 2, 5, 3, 6)
        else:  # [h, b, row, c, 32] -> [b, h, c, row, 32]
            data = padded.view(halves, blocks, ROWS, chunks, CHUNK).permute(1, 0, 3, 2, 4)
        return cls(data.contiguous().view(-1), n, k, swiglu, None if scale is None else scale.contiguous())

    def unpack(self) -> torch.Tensor:
        """[rows, cols] row-major, bf16, or int8 (unscaled)."""
        halves, rows_out, blocks, chunks = _geometry(self.rows, self.cols, self.swiglu)
        if self.data.dtype == torch.int8:
            t = self.data.view(blocks, halves, chunks, 2, 4, 2, 8).permute(1, 0, 3, 5, 2, 4, 6)
        else:
            t = self.data.view(blocks, halves, chunks, ROWS, CHUNK).permute(1, 0, 3, 2, 4)
        t = t.reshape(halves, blocks * ROWS, chunks * CHUNK)[:, :rows_out, : self.cols]
        return t.reshape(self.rows, self.cols)
