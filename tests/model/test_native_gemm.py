"""Larger bf16 steps through the native panel products (kernels/cpu_gemm.c) against the same
model through oneDNN's prepacked linears, on tiny random checkpoints of each architecture
(Qwen2's q/k/v bias, Qwen3's q/k norm): a ragged prefill and decode batches past gemv's rows,
teacher-forced along one token path so every step compares like with like."""

from __future__ import annotations

import pytest
import torch
from support.model_util import bf16_runner, greedy_generate, random_prompts

from pdserve.engine.model_executor.layers import GEMV_MAX_ROWS
from pdserve.kernels.cpu_native import native_kernels
from pdserve.kernels.gemm_layout import PanelWeight

native = native_kernels()
pytestmark = pytest.mark.skipif(native is None or not native.has_gemm,
                                reason="needs AVX-512 BF16 (without AMX) and a C compiler")
NEW = 8


def test_panel_steps_match_onednn_steps(ckpt, monkeypatch):
    torch.set_num_threads(2)
    # op by op, so every product is a call here (the fused step runs the same kernels: its test)
    on = bf16_runner(ckpt, disable_fused_decode=True)
    off = bf16_runner(ckpt, disable_native_gemm=True)
    calls = []
    monkeypatch.setattr(native, "gemm", lambda *a, _gemm=native.gemm, **k: calls.append(1) or _gemm(*a, **k))
    assert on.model.plan.gemm and isinstance(on.model.model.layers[0].self_attn.qkv_proj.method.large, PanelWeight)
    assert not off.model.plan.gemm and isinstance(off.model.model.layers[0].self_attn.qkv_proj.method.large,
                                                     torch.Tensor)
    for bs in (GEMV_MAX_ROWS + 1, 9):  # every step past gemv's: prefill and decode take the panels
        prompts = random_prompts([2 + 7 * i for i in range(bs)], seed=bs)
        path, want = greedy_generate(off, prompts, NEW)
        assert not calls
        got = greedy_generate(on, prompts, NEW, forced=path)[1]
        # every step: 4 products per layer and the LM head
        assert len(calls) == NEW * (4 * len(on.model.model.layers) + 1), len(calls)
        calls.clear()
        for g, w in zip(got, want):
            # bf16 products summed in another order: logits within a few bf16 ulps of the activations
            assert (g - w).abs().max() <= 0.05 * w.std(), (bs, (g - w).abs().max(), w.std())


def test_weights_by_name_read_back_from_the_panels(ckpt):
    # with gemv off, the panels are the model's only bf16 copy of each matrix
    from safetensors.torch import load_file

    from pdserve.engine.model_executor.weight_names import weight_by_name

    model = bf16_runner(ckpt, disable_decode_gemv=True).model
    assert model.plan.gemm and model.model.layers[1].self_attn.qkv_proj.method.gemv is None
    checkpoint = load_file(f"{ckpt}/model.safetensors")
    projections = ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                   "mlp.down_proj")
    names = [f"model.layers.1.{n}.weight" for n in projections]
    for name in names + (["lm_head.weight"] if "lm_head.weight" in checkpoint else []):
        assert torch.equal(weight_by_name(model, name), checkpoint[name].bfloat16().float()), name
