"""A GGUF file's Q8_0 weights under --quantization w8a16: kept as stored (int8 and a scale per
block of 32 columns) rather than dequantized and quantized again per channel. The file is the
default model (SmolLM2-135M-Instruct) written out with its matrices as Q8_0."""

from __future__ import annotations

import pytest
import torch
from support.model_util import greedy_generate, write_q8_0_gguf

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_loader import load_model, read_q8_0_blocks
from pdserve.engine.model_source import resolve_model_path
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.model_executor.layers import GEMV_MAX_ROWS
from pdserve.kernels.cpu_native import native_kernels

native = native_kernels()
needs_gemv = pytest.mark.skipif(native is None or not native.has_gemv,
                                reason="needs AVX-512 BF16 or AVX2, and a C compiler")
PROMPTS = ["The capital of France is", "Water boils at", "One, two, three,", "The cat sat on"]


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("q8_0") / "smollm2-q8_0.gguf")
    write_q8_0_gguf(resolve_model_path(None).path, path)
    return path


def test_blocks_are_the_loaded_matrices(q8_file):
    # q * d per block is exactly what load_model dequantizes (q and k after llama.cpp's row permutation)
    arch, weights, _ = load_model(q8_file)
    blocks = read_q8_0_blocks(q8_file, arch)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.5.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight"):
        q, d = blocks[name]
        n, k = q.shape
        assert torch.equal((q.float().view(n, -1, 32) * d[:, :, None]).view(n, k), weights[name]), name


@needs_gemv
def test_w8a16_keeps_q8_0_and_agrees_with_bf16(q8_file):
    torch.set_num_threads(2)
    runners = {name: ModelRunner(EngineConfig(model_path=q8_file, dtype="bfloat16", max_total_tokens=4096, **kw))
               for name, kw in (("bf16", {}), ("w8a16", dict(quantization="w8a16")),
                                ("ops", dict(quantization="w8a16", disable_fused_decode=True)))}
    model = runners["w8a16"].model
    assert all(layer.self_attn.qkv_proj.q8_0 for layer in model.model.layers)
    # the layers' int8 are the file's, with its block scales (q | k | v stacked)
    blocks = read_q8_0_blocks(q8_file, runners["w8a16"].arch)
    a = "model.layers.3.self_attn."
    qkv = model.model.layers[3].self_attn.qkv_proj.method.gemv
    assert qkv.blocked and torch.equal(qkv.unpack(), torch.cat([blocks[a + p + "_proj.weight"][0] for p in "qkv"]))
    assert torch.equal(qkv.scale, torch.cat([blocks[a + p + "_proj.weight"][1] for p in "qkv"]))
    assert model.lm_head.method.gemv.blocked  # the tied head: the file's token embedding, Q8_0 too
    tok = runners["bf16"].tokenizer
    prompts = [tok(p).input_ids for p in PROMPTS]
    assert len(prompts) <= GEMV_MAX_ROWS  # decode steps through gemv's block-scaled int8
    out = {name: greedy_generate(r, prompts, 16) for name, r in runners.items()}
    # the fused step is the per-op path bit for bit
    assert out["w8a16"][0] == out["ops"][0]
    assert all(torch.equal(g, w) for g, w in zip(out["w8a16"][1], out["ops"][1]))
    # against bf16 of the same file (its weights are q * d rounded to bf16): measured 46 of 48
    same = total = 0
    for want, got in zip(out["bf16"][0], out["w8a16"][0]):
        for x, y in zip(want, got):
            total += 1
            same += x == y
            if x != y:
                break
    assert same / total >= 0.9, (same, total)
