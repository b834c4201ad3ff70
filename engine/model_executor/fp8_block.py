"""DeepSeek-V3's own checkpoint format: FP8 (e4m3) weights in blocks of 128 x 128, each block with
one float32 ``weight_scale_inv`` (the dequantized weight is ``w * scale_inv``). pdserve loads such a
checkpoint by dequantizing each weight to the model dtype at load; the engine's own weight formats
(bf16, w8a16, w8a8) then apply as to any checkpoint. Any other stored quantization is refused by
name (``check_fp8_block_config``)."""

from __future__ import annotations

import torch

FP8_BLOCK = 128
SCALE_SUFFIX = "_scale_inv"


def check_fp8_block_config(qc: dict) -> tuple[int, int]:
    """The block of a ``quantization_config`` pdserve can dequantize at load; ValueError naming it otherwise."""
    method = qc.get("quant_method", "unknown")
    block = qc.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2 or qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"the checkpoint is quantized with {method!r} (weight_block_size {block}), which pdserve "
                         "cannot load; supported: fp8 e4m3 with block scales (DeepSeek-V3's format, dequantized "
                         "at load) or an unquantized checkpoint")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"fp8 activation_scheme {qc['activation_scheme']!r} is not supported (supported: dynamic)")
    return int(block[0]), int(block[1])


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                      block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale_inv [ceil(N / bn), ceil(K / bk)] -> [N, K] float32."""
    n, k = weight.shape
    bn, bk = block
    if scale_inv.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a [{n}, {k}] weight "
                         f"in blocks of {bn} x {bk}")
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * scale


def dequant_checkpoint(weights: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Every ``X.weight`` with an ``X.weight_scale_inv`` dequantized (the scales dropped), the rest as is."""
    out = {}
    for name, t in weights.items():
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in weights:
                raise ValueError(f"{name} has no weight to scale")
            continue
        scale = weights.get(name + SCALE_SUFFIX)
        out[name] = t if scale is None else dequant_fp8_block(t, scale, block)
    return out
