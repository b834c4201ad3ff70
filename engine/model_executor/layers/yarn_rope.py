"""DeepSeek's rotary embedding of the rope part of q and k: plain or YaRN-scaled frequencies
(``rope_scaling`` of type "yarn" with ``mscale``/``mscale_all_dim``), as transformers computes
them, applied to interleaved pairs (DeepSeek's layout: dims 2i and 2i+1 turn by frequency i) or
to rotate-half pairs. The output puts each pair's halves apart ``[x1', x2']``; q and k are
rotated alike, so their products equal those of the interleaved output."""

from __future__ import annotations

import math

import torch


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude factor: 0.1 mscale ln(scale) + 1 (1 when not scaled up)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_parameters(cfg: dict) -> dict:
    """The rope settings of a config.json: ``rope_scaling`` (older files) updated by
    ``rope_parameters`` (transformers >= 5), with ``rope_theta``."""
    rope = dict(cfg.get("rope_scaling") or {})
    rope.update(cfg.get("rope_parameters") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    return rope


def softmax_scale(rope: dict, qk_head_dim: int) -> float:
    """Scores' scale: qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim ** -0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        m = yarn_get_mscale(rope["factor"], rope["mscale_all_dim"])
        scale *= m * m
    return scale


def rope_tables(rope: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2] float32, the cos/sin factor) of ``rope``: default or yarn."""
    base = float(rope["rope_theta"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    kind = rope["rope_type"]
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ValueError(f"DeepSeek rope scaling type {kind!r} is not supported (supported: default, yarn)")
    orig = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or max_positions / orig
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
                            if mscale and mscale_all else yarn_get_mscale(factor))
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class LatentRope:
    """cos, sin [max_positions, dim / 2] (times YaRN's factor) in the model dtype; ``forward``
    rotates [T, heads, dim] at ``begin_step``'s positions."""

    def __init__(self, rope: dict, dim: int, max_positions: int, interleaved: bool, dtype: torch.dtype,
                 device: torch.device | str):
        inv_freq, factor = rope_tables(rope, dim, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [ctx, dim / 2]
        self.cos = (freqs.cos() * factor).to(device=device, dtype=dtype)
        self.sin = (freqs.sin() * factor).to(device=device, dtype=dtype)
        self.interleaved = interleaved
        self._cos = self._sin = None

    def begin_step(self, positions: torch.Tensor) -> None:
        self._cos = self.cos.index_select(0, positions)[:, None, :]  # [T, 1, dim / 2]
        self._sin = self.sin.index_select(0, positions)[:, None, :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, dim] -> [T, heads, dim], halves ``[x1 c - x2 s, x2 c + x1 s]``."""
        half = x.shape[-1] // 2
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if self.interleaved else (x[..., :half], x[..., half:])
        c, s = self._cos, self._sin
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
