"""The int8 weight layout of w8a8's AMX products (``cpu_amx_int8.c``), packed once at load. Pure torch.

``tdpbssd`` multiplies a tile of A (16 rows x 64 int8) by a tile of B holding 16 columns' 64
values as ``[16 (k / 4)][16 columns][4 (k % 4)]``. A weight W [N, K] is packed as such B tiles:
blocks of 32 output columns (two tiles), each block ``K / 64`` steps of its two tiles (2 KB), so
the kernel reads a block front to back. K is padded with zero columns to a multiple of 64 and
the last block with zero columns. SwiGLU (rows gate | up): a block is 16 gate rows (tile 0) and
the same 16 rows of up (tile 1). Flat: ``[blocks, K / 64, 2, 16, 16, 4]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COLS = 32  # output columns a block (COLS in cpu_amx_int8.c)
KSTEP = 64  # K columns a step (KSTEP there)
ROWS = 32  # activation rows a block (its two A tiles): the activations are padded to a multiple
TILE = 16


def _geometry(rows: int, cols: int, swiglu: bool) -> tuple[int, int]:
    """(blocks, steps) of a [rows, cols] weight packed as ``swiglu`` says."""
    return -(-(rows // 2 if swiglu else rows) // (TILE if swiglu else COLS)), -(-cols // KSTEP)


@dataclass(frozen=True)
class AmxInt8Weight:
    """An int8 weight [rows, cols] with one float32 scale per row, packed for AMX's int8 products.
    ``swiglu``: rows are gate | up, multiplied as SwiGLU."""

    data: torch.Tensor  # flat, packed, int8
    scale: torch.Tensor  # [rows] float32
    rows: int
    cols: int
    swiglu: bool

    @classmethod
    def pack(cls, q: torch.Tensor, scale: torch.Tensor, swiglu: bool = False) -> "AmxInt8Weight":
        """``q`` [N, K] int8 (any strides), ``scale`` [N] float32."""
        n, k = q.shape
        assert q.dtype == torch.int8 and scale.shape == (n,) and (not swiglu or n % 2 == 0)
        blocks, steps = _geometry(n, k, swiglu)
        if swiglu:  # block b: gate rows 16 b.., then the same rows of up
            half, width = n // 2, blocks * TILE
            gate, up = q.new_zeros(width, steps * KSTEP), q.new_zeros(width, steps * KSTEP)
            gate[:half, :k], up[:half, :k] = q[:half], q[half:]
            padded = torch.stack([gate.view(blocks, TILE, -1), up.view(blocks, TILE, -1)], dim=1)
        else:
            padded = q.new_zeros(blocks * COLS, steps * KSTEP)
            padded[:n, :k] = q
        # [block, tile, column, step, k / 4, k % 4] -> [block, step, tile, k / 4, column, k % 4]
        data = padded.view(blocks, 2, TILE, steps, TILE, 4).permute(0, 3, 1, 4, 2, 5)
        return cls(data.contiguous().view(-1), scale.float().contiguous(), n, k, swiglu)

    def unpack(self) -> torch.Tensor:
        """[rows, cols] int8, row-major."""
        blocks, steps = _geometry(self.rows, self.cols, self.swiglu)
        t = self.data.view(blocks, steps, 2, TILE, TILE, 4).permute(0, 2, 4, 1, 3, 5)
        t = t.reshape(blocks, 2, TILE, steps * KSTEP)
        if not self.swiglu:
            return t.reshape(blocks * COLS, -1)[: self.rows, : self.cols]
        half = self.rows // 2
        gate, up = (t[:, i].reshape(blocks * TILE, -1)[:half, : self.cols] for i in (0, 1))
        return torch.cat([gate, up])
