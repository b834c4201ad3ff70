"""Greedy output of ModelRunner against Hugging Face transformers on the same weights.

The default model (SmolLM2-135M GGUF, dequantized by our loader) is saved as a
HF checkpoint and loaded by transformers' LlamaForCausalLM; tiny random Qwen2
and Qwen3 checkpoints are made by transformers and loaded by our loader.
"""

from __future__ import annotations

import pytest
import torch
from support.model_util import greedy_generate, hf_greedy, make_tiny_checkpoint

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_loader import load_model, save_hf_checkpoint
from pdserve.engine.model_executor.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(240)
torch.set_num_threads(1)  # robust when other jobs share the 2 cores (OpenMP spin-waits)

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of copper.",
    "Hi",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    arch, weights, _ = load_model(None)
    path = tmp_path_factory.mktemp("smollm2_hf")
    save_hf_checkpoint(arch, weights, str(path))
    return str(path)


def runner_for(dtype: str, model_path=None) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=model_path, dtype=dtype, max_total_tokens=4096, page_size=16))


def chat_prompts(tokenizer) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def test_default_model_fp32_token_identical_to_transformers(hf_dir):
    from transformers import LlamaForCausalLM

    runner = runner_for("float32")
    assert runner.dtype == torch.float32 and runner.arch.num_layers == 30
    prompts = chat_prompts(runner.tokenizer)
    assert len({len(p) for p in prompts}) > 1  # mixed lengths in one batch
    ours, _ = greedy_generate(runner, prompts, NEW_TOKENS)
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        want, _ = hf_greedy(hf, prompt, NEW_TOKENS)
        assert got == want, runner.tokenizer.decode(got) + " != " + runner.tokenizer.decode(want)
    assert "Paris" in runner.tokenizer.decode(ours[0])


def assert_only_near_ties(runner, prompts, hf_runs) -> None:
    """Teacher-force ``runner`` along transformers' greedy path, so every position compares like with
    like; where the two pick different tokens, each one's pick is in the other's top-3."""
    ours, our_logits = greedy_generate(runner, prompts, NEW_TOKENS, forced=[t for t, _ in hf_runs])
    differ = 0
    for (want, hf_logits), got, logits in zip(hf_runs, ours, our_logits):
        for t, (a, b) in enumerate(zip(got, want)):
            if a != b:
                differ += 1
                assert b in logits[t].topk(3).indices.tolist(), f"step {t}: transformers' {b} not in our top-3"
                assert a in hf_logits[t].topk(3).indices.tolist(), f"step {t}: our {a} not in transformers' top-3"
    assert differ <= len(prompts) * NEW_TOKENS // 4  # near-ties are the exception, not the rule


def test_default_model_bf16_differs_only_at_near_ties(hf_dir):
    from transformers import LlamaForCausalLM

    runner = runner_for("bfloat16")
    assert runner.dtype == torch.bfloat16
    prompts = chat_prompts(runner.tokenizer)
    hf = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    hf_runs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert_only_near_ties(runner, prompts, hf_runs)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_tiny_random_checkpoint_fp32_token_identical(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    make_tiny_checkpoint(kind, str(tmp_path))
    runner = runner_for("float32", str(tmp_path))
    assert runner.arch.arch == kind
    assert runner.arch.attention_bias == (kind == "qwen2") and runner.arch.qk_norm == (kind == "qwen3")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 23, 40, 1)]
    ours, _ = greedy_generate(runner, prompts, NEW_TOKENS)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        want, _ = hf_greedy(hf, prompt, NEW_TOKENS)
        assert got == want
    assert len({t for seq in ours for t in seq}) > 10  # not a degenerate constant output


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_tiny_random_checkpoint_bf16_differs_only_at_near_ties(kind, tmp_path):
    # bf16 runs the native RMSNorm and rope (after Qwen3's q/k norm, with Qwen2's q/k/v bias)
    from transformers import AutoModelForCausalLM

    make_tiny_checkpoint(kind, str(tmp_path))
    runner = runner_for("bfloat16", str(tmp_path))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 23, 40)]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    hf_runs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    assert_only_near_ties(runner, prompts, hf_runs)


def test_unknown_model_path_is_value_error_naming_it(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match="model_path.*no_such_model"):
        runner_for("float32", missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="model_path.*empty"):
        load_model(str(tmp_path / "empty"))
