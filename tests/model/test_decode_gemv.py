"""Small decode steps through native gemv (bf16) and weight-only int8 (w8a16), on tiny random
checkpoints, against the same model with gemv off (every step through oneDNN) and in bf16.

Both runs are teacher-forced along one token path, so every step compares like with like."""

from __future__ import annotations

import pytest
import torch
from support.model_util import assert_picks_agree_but_near_ties, bf16_runner, greedy_generate, random_prompts

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.model_executor.layers import GEMV_MAX_ROWS
from pdserve.kernels.cpu_native import native_kernels

torch.set_num_threads(1)
native = native_kernels()
needs_gemv = pytest.mark.skipif(native is None or not native.has_gemv,
                                reason="needs AVX-512 BF16 or AVX2, and a C compiler")
NEW = 12
# the stated w8a16 error on these checkpoints: max |logit - bf16 logit| over every step, as a
# fraction of the bf16 logits' std (per-channel int8 of weights drawn with std 0.1). Measured
# 0.11-0.18 over the three checkpoints and both paths; a wrong scale or layout gives > 1.
W8_LOGIT_ERROR = 0.25


def forced_logits(runner, prompts, path):
    return greedy_generate(runner, prompts, NEW, forced=path)[1]


@needs_gemv
def test_gemv_steps_match_onednn_steps(ckpt):
    on, off = bf16_runner(ckpt), bf16_runner(ckpt, disable_decode_gemv=True)
    assert on.model.plan.gemv_rows == GEMV_MAX_ROWS and off.model.plan.gemv_rows == 0
    # every batch size gemv takes, ragged prompt lengths, and one past it (all through oneDNN)
    for bs in [*range(1, GEMV_MAX_ROWS + 1), GEMV_MAX_ROWS + 2]:
        prompts = random_prompts([3 + 5 * i for i in range(bs)], seed=bs)
        path, want = greedy_generate(off, prompts, NEW)
        got = forced_logits(on, prompts, path)
        for g, w in zip(got, want):
            if bs > GEMV_MAX_ROWS:
                assert torch.equal(g, w)  # the same kernels on both sides
            else:
                # bf16 products summed in another order: logits within a few bf16 ulps of the activations
                # (measured up to 0.036 of their std against oneDNN's bf16 kernel on AVX-512 BF16, 0.061
                # against torch's bf16 linear on AVX2, where each side is 0.03-0.11 from float32's logits;
                # a wrong layout or scale gives > 1)
                assert (g - w).abs().max() <= 0.08 * w.std(), (bs, (g - w).abs().max(), w.std())
        ours, _ = greedy_generate(on, prompts, NEW, forced=path)
        assert_picks_agree_but_near_ties(ours, path, want)


@pytest.mark.parametrize("gemv", [True, False])
def test_w8a16_logits_within_stated_error_of_bf16(ckpt, gemv):
    if gemv and (native is None or not native.has_gemv):
        pytest.skip("needs AVX-512 BF16 or AVX2")
    bf16 = bf16_runner(ckpt)
    w8 = bf16_runner(ckpt, quantization="w8a16", disable_decode_gemv=not gemv)
    assert w8.model.plan.quantization == "w8a16"
    # the prefill (31 tokens) on AMX-BF16 over gemv's int8 where the CPU has it (w8_amx_linear)
    assert w8.model.plan.w8_amx == (gemv and native.has_w8_amx)
    # the KV layout the transfer layer pairs prefill and decode by names the weights' quantization
    assert (bf16.page_pool.layout().quantization, w8.page_pool.layout().quantization) == ("none", "w8a16")
    prompts = random_prompts([7, 23, 1], seed=5)  # 3 sequences: gemv takes their decode steps when on
    path, want = greedy_generate(bf16, prompts, NEW)
    got = forced_logits(w8, prompts, path)
    for g, w in zip(got, want):
        err = (g - w).abs().max() / w.std()
        assert 0 < err <= W8_LOGIT_ERROR, err  # > 0: the int8 weights are really in use


@needs_gemv
def test_w8a16_gemv_and_dequantized_paths_agree(ckpt):
    # the same int8 weights: in place through gemv at small steps, dequantized per matrix otherwise
    a = bf16_runner(ckpt, quantization="w8a16")
    b = bf16_runner(ckpt, quantization="w8a16", disable_decode_gemv=True)
    prompts = random_prompts([9, 4], seed=6)
    path, want = greedy_generate(b, prompts, NEW)
    for g, w in zip(forced_logits(a, prompts, path), want):
        # gemv scales in float32, the dense path rounds each dequantized weight to bf16 first
        assert (g - w).abs().max() <= 0.1 * w.std()


def test_w8a16_portable_torch_path_in_float32(ckpt):
    # float32: no native kernels at all (norms, rope and products in torch), the path any CPU has
    f32 = ModelRunner(EngineConfig(model_path=ckpt, dtype="float32", max_total_tokens=2048, page_size=4))
    w8 = ModelRunner(EngineConfig(model_path=ckpt, dtype="float32", max_total_tokens=2048, page_size=4,
                                  quantization="w8a16"))
    assert w8.model.plan.native is None and w8.model.plan.gemv_rows == 0
    prompts = random_prompts([7, 23, 1], seed=7)
    path, want = greedy_generate(f32, prompts, NEW)
    for g, w in zip(forced_logits(w8, prompts, path), want):
        err = (g - w).abs().max() / w.std()
        assert 0 < err <= W8_LOGIT_ERROR, err


@needs_gemv
@pytest.mark.parametrize("quantization", ["none", "w8a16"])
def test_weights_by_name_read_back_from_the_packed_gemv_copies(ckpt, quantization):
    # bf16 prepacked for oneDNN answers from gemv's packed copy; w8a16 holds only the packed int8
    from safetensors.torch import load_file

    from pdserve.engine.model_executor.quantization import Int8Weight
    from pdserve.engine.model_executor.weight_names import weight_by_name

    model = bf16_runner(ckpt, quantization=quantization).model
    checkpoint = load_file(f"{ckpt}/model.safetensors")
    projections = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj")
    names = [f"model.layers.1.{n}.weight" for n in projections]
    for name in names + (["lm_head.weight"] if "lm_head.weight" in checkpoint else []):
        want = checkpoint[name].bfloat16()
        want = Int8Weight.quantize(want).dequantize(torch.float32) if quantization == "w8a16" else want.float()
        assert torch.equal(weight_by_name(model, name), want), name
