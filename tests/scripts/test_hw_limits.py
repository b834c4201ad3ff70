"""scripts/benchlib/hw_limits.py: the weight and FLOP counts bench_engine divides by, and the
measured limits being positive rates."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from benchlib.hw_limits import gemm_rate, linear_params, read_bandwidth_gbs, step_flops  # noqa: E402

# SmolLM2-135M's shape (the default model): ~270 MB of bf16 weights per decode step
SMOL = SimpleNamespace(hidden_size=576, intermediate_size=1536, head_dim=64, num_heads=9, num_kv_heads=3,
                       num_layers=30, vocab_size=49152)


def test_linear_params_of_the_default_model():
    per_layer = 576 * 15 * 64 + 576 * 576 + 3 * 576 * 1536
    assert linear_params(SMOL) == 30 * per_layer + 49152 * 576
    assert 265e6 < 2 * linear_params(SMOL) < 275e6


def test_step_flops_linear_and_attention_parts():
    one = step_flops(SMOL, 1, 0, 1)
    attention_one_key = 4 * 9 * 64 * 1 * 30
    assert one == 2 * linear_params(SMOL) + attention_one_key
    # 100 more cached keys add only attention; a prompt of n tokens sampling 1 row pays the head once
    assert step_flops(SMOL, 1, 100, 1) - one == 4 * 9 * 64 * 100 * 30
    prompt = step_flops(SMOL, 8, 0, 1)
    head = 2 * 49152 * 576
    assert prompt == 8 * (one - head - attention_one_key) + head + 4 * 9 * 64 * 36 * 30


def test_measured_limits_are_rates():
    assert read_bandwidth_gbs(mbytes=16, repeats=2) > 0.1
    assert gemm_rate(256) > 0.1  # bf16, prepacked where the CPU allows it
    assert gemm_rate(256, dtype=torch.float32) > 0.1
