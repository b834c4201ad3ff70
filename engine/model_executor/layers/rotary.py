"""Rotate-half rotary embedding over q and k together, with tables built as transformers builds
them (float32 angles, cast to the model dtype); llama3 and linear scaling."""

from __future__ import annotations

import math

import torch

from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan


def rope_inv_freq(head_dim: int, theta: float, linear_factor: float = 1.0,
                  llama3: tuple[float, float, float, int] | None = None) -> torch.Tensor:
    """[D / 2] float32 inverse frequencies, with llama3 or linear scaling as transformers does it."""
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if linear_factor != 1.0:
        inv_freq = inv_freq / linear_factor
    if llama3 is not None:
        factor, low, high, orig = llama3
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    """cos, sin [max_positions, D] in the model dtype; ``forward`` rotates [T, heads, D]."""

    def __init__(self, plan: KernelPlan, inv_freq: torch.Tensor, max_positions: int):
        self.native = plan.native
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [ctx, D / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [ctx, D]
        self.cos = emb.cos().to(device=plan.device, dtype=plan.dtype)
        self.sin = emb.sin().to(device=plan.device, dtype=plan.dtype)
        self._positions: torch.Tensor | None = None
        self._cos = self._sin = None

    def begin_step(self, positions: torch.Tensor) -> None:
        """This step's positions [T] int64, for every layer's ``forward`` (torch's path gathers
        its tables' rows here, once a step)."""
        self._positions = positions
        if self.native is None:
            self._cos = self.cos.index_select(0, positions)[:, None, :]  # [T, 1, D]
            self._sin = self.sin.index_select(0, positions)[:, None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] at ``begin_step``'s positions: x * cos + [-x2, x1] * sin, [T, heads, D]."""
        if self.native is not None:
            return self.native.rope(x, self.cos, self.sin, self._positions)
        half = x.shape[-1] // 2
        return x * self._cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * self._sin
