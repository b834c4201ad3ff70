"""The weight layout of the native bf16 products (``cpu_gemm.c``), packed once at load. Pure torch.

A panel is 64 output rows of W, stored column pair by column pair: for each pair (k, k+1), the
64 rows' two values side by side, ``[K / 2, 64, 2]``, which is the operand ``vdpbf16ps`` takes
(16 rows' pairs per vector). The kernel reads a panel front to back, 4 vectors per column pair,
so a product's weights are one sequential stream panel after panel. The last panel is padded
with zero rows and an odd K with a zero column. SwiGLU (rows gate | up): each panel is 32 gate
rows followed by the same 32 rows of up, so one panel gives 32 finished output columns.
Flat: ``[panels, ceil(K / 2), 64, 2]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL = 64  # W rows per panel (NB in cpu_gemm.c)


def _geometry(rows: int, cols: int, swiglu: bool) -> tuple[int, int]:
    """(panels, column pairs) of a [rows, cols] weight packed as ``swiglu`` says."""
    width = PANEL // 2 if swiglu else PANEL  # output rows per panel
    return -(-(rows // 2 if swiglu else rows) // width), -(-cols // 2)


@dataclass(frozen=True)
class PanelWeight:
    """A bf16 weight [rows, cols] packed for the native products. ``swiglu``: rows are gate | up,
    multiplied as SwiGLU."""

    data: torch.Tensor  # flat, packed, bf16
    rows: int
    cols: int
    swiglu: bool

    @classmethod
    def pack(cls, w: torch.Tensor, swiglu: bool = False) -> "PanelWeight":
        """``w`` [N, K] bf16."""
        n, k = w.shape
        assert w.dtype == torch.bfloat16 and (not swiglu or n % 2 == 0)
        panels, pairs = _geometry(n, k, swiglu)
        if swiglu:  # each panel: its 32 output rows of gate, then the same rows of up
            half, width = n // 2, PANEL // 2
            padded = w.new_zeros(2, panels * width, pairs * 2)
            padded[:, :half, :k] = w.view(2, half, k)
            rows_major = padded.view(2, panels, width, pairs * 2).transpose(0, 1).reshape(panels, PANEL, pairs * 2)
        else:
            rows_major = w.new_zeros(panels * PANEL, pairs * 2)
            rows_major[:n, :k] = w
            rows_major = rows_major.view(panels, PANEL, pairs * 2)
        # [panel, row, pair, 2] -> [panel, pair, row, 2]
        data = rows_major.view(panels, PANEL, pairs, 2).permute(0, 2, 1, 3)
        return cls(data.contiguous().view(-1), n, k, swiglu)

    def unpack(self) -> torch.Tensor:
        """[rows, cols] row-major bf16."""
        panels, pairs = _geometry(self.rows, self.cols, self.swiglu)
        t = self.data.view(panels, pairs, PANEL, 2).permute(0, 2, 1, 3).reshape(panels, PANEL, pairs * 2)
        if not self.swiglu:
            return t.reshape(panels * PANEL, pairs * 2)[: self.rows, : self.cols]
        half, width = self.rows // 2, PANEL // 2
        t = t.view(panels, 2, width, pairs * 2).transpose(0, 1).reshape(2, panels * width, pairs * 2)
        return t[:, :half, : self.cols].reshape(self.rows, self.cols)
