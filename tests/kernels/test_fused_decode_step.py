"""The fused decode step (kernels/cpu_decode_layer.c through decode_step.DecodeStack) against the
same model stepping op by op (--disable-fused-decode): bit-identical logits and K/V pages on the
tiny random checkpoints, at every batch size gemv takes, in bf16 and w8a16, and in bf16 past
them where the products are gemm's over the panels."""

from __future__ import annotations

import sys

import pytest
import torch
from support.model_util import bf16_runner, greedy_generate, make_tiny_checkpoint, random_prompts

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.layers import GEMV_MAX_ROWS
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.kernels.cpu_native import native_kernels

torch.set_num_threads(1)
native = native_kernels()
needs_gemv = pytest.mark.skipif(native is None or not native.has_gemv,
                                reason="needs AVX-512 BF16 or AVX2, and a C compiler")
NEW = 10


def fused_rows(model) -> int:
    """Decode steps of at most this many rows run as one DecodeStack call (0: never)."""
    return model.fused.max_rows if model.fused is not None else 0

@pytest.fixture(scope="module", params=["llama", "qwen2"])  # qwen2: the q/k/v bias
def ckpt(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"fused_{request.param}"))
    make_tiny_checkpoint(request.param, path)
    return path



@needs_gemv
@pytest.mark.parametrize("quantization", ["none", "w8a16"])
def test_fused_steps_bit_identical_to_op_by_op(ckpt, quantization):
    fused, ops = bf16_runner(ckpt, quantization=quantization), bf16_runner(ckpt, quantization=quantization,
                                                                          disable_fused_decode=True)
    # bf16 with native gemm: every step size; else gemv's
    panels = quantization == "none" and native.has_gemm
    assert fused_rows(fused.model) == (sys.maxsize if panels else GEMV_MAX_ROWS) and fused_rows(ops.model) == 0
    # every batch size gemv takes, ragged prompts (pages of 4: some steps cross a page), and past
    # them (gemm's panels, or op by op on both sides)
    for bs in [*range(1, GEMV_MAX_ROWS + 1), GEMV_MAX_ROWS + 1, 13]:
        prompts = random_prompts([2 + 5 * i for i in range(bs)], seed=bs)
        want_tokens, want = greedy_generate(ops, prompts, NEW)
        got_tokens, got = greedy_generate(fused, prompts, NEW)
        assert got_tokens == want_tokens
        for g, w in zip(got, want):
            assert torch.equal(g, w), (bs, (g - w).abs().max())
    assert fused.model.fused.stack is not None  # the fused path really ran


def _one_step(runner: ModelRunner, prompts: list[list[int]], sampled: list[int], after_layer=None):
    """Prefill ``prompts`` (one batch), then one decode step that samples the rows ``sampled``:
    (that step's logits, the page pool's K and V of every layer)."""
    pool, ps = runner.page_pool, runner.page_pool.page_size
    lens = [len(p) for p in prompts]
    owned = [pool.alloc(pool.pages_for(n + 1)) for n in lens]
    pages = torch.zeros(len(lens), max(map(len, owned)), dtype=torch.int32)  # padded with page 0
    for i, row in enumerate(owned):
        pages[i, : len(row)] = torch.tensor(row)

    def slot(i: int, pos: int) -> int:
        return int(pages[i, pos // ps]) * ps + pos % ps

    runner.forward(ForwardBatch(
        input_ids=torch.tensor([t for p in prompts for t in p]), positions=torch.cat([torch.arange(n) for n in lens]),
        out_cache_loc=torch.tensor([slot(i, j) for i, n in enumerate(lens) for j in range(n)]), page_table=pages,
        logits_indices=torch.tensor(lens).cumsum(0) - 1, extend_lens=lens, seq_lens=lens))
    logits = runner.forward(ForwardBatch(
        input_ids=torch.tensor([p[-1] for p in prompts]), positions=torch.tensor(lens),
        out_cache_loc=torch.tensor([slot(i, n) for i, n in enumerate(lens)]), page_table=pages,
        logits_indices=torch.tensor(sampled), extend_lens=[1] * len(lens), seq_lens=[n + 1 for n in lens]),
        after_layer)
    return logits, [t.clone() for t in (*pool.k, *pool.v)]


@needs_gemv
@pytest.mark.parametrize("bs", [3, 9])  # gemv's rows; past them, gemm's (where the CPU has it)
def test_fused_step_sampled_rows_kv_pages_and_after_layer(ckpt, bs):
    fused, ops = bf16_runner(ckpt), bf16_runner(ckpt, disable_fused_decode=True)
    prompts = random_prompts([5, 9, 2, 4, 7, 1, 3, 8, 6][:bs], seed=11)
    sampled = [2, 0]  # fewer rows than the step's, out of order: the last layer's selection
    want, want_kv = _one_step(ops, prompts, sampled)
    called = []
    got, got_kv = _one_step(fused, prompts, sampled, after_layer=called.append)
    assert got.shape == (2, fused.arch.vocab_size) and torch.equal(got, want)
    assert all(torch.equal(g, w) for g, w in zip(got_kv, want_kv))  # the new K/V at their slots, nothing else
    assert called == list(range(fused.arch.num_layers))  # one call per layer, in order, with after_layer


def test_fused_step_only_where_it_is_exact(tmp_path):
    # Qwen3's q/k norm is torch's float32 mean, whose sum order the C kernel does not reproduce: op by op.
    # float32 has no native kernels at all (any CPU's path): neither gemv nor the fused step.
    make_tiny_checkpoint("qwen3", str(tmp_path))
    if native is not None and native.has_gemv:
        assert fused_rows(bf16_runner(str(tmp_path)).model) == 0
    f32 = ModelRunner(EngineConfig(model_path=str(tmp_path), dtype="float32", max_total_tokens=2048, page_size=4))
    assert fused_rows(f32.model) == 0 and f32.model.plan.gemv_rows == 0
    tokens, _ = greedy_generate(f32, random_prompts([3, 6], seed=3), 3)
    assert all(len(t) == 3 for t in tokens)
