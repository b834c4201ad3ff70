"""Greedy parity with transformers for the architectures built from ``layers/``: Qwen3-MoE
(routed experts through the fused expert kernel) and Gemma 3 (sliding-window layers, Gemma's
norms, GeLU, soft-capped logits), on tiny random checkpoints that transformers makes."""

from __future__ import annotations

import pytest
import torch
from support.model_util import greedy_generate, hf_greedy, hf_model, make_tiny_checkpoint
from safetensors.torch import load_file

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.layers.moe_fused import FusedMoEMethod
from pdserve.engine.model_executor.layers.sliding_window import SlidingWindowAttention
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.model_executor.weight_names import weight_by_name

pytestmark = pytest.mark.timeout(240)
torch.set_num_threads(1)

NEW_TOKENS = 16
KINDS = ["qwen3_moe", "gemma3"]


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"tiny_{request.param}"))
    make_tiny_checkpoint(request.param, path)
    return request.param, path


def runner_for(dtype: str, path: str) -> ModelRunner:
    return ModelRunner(EngineConfig(model_path=path, dtype=dtype, max_total_tokens=2048, page_size=4))


def test_fp32_token_identical_to_transformers(tiny):
    kind, path = tiny
    runner = runner_for("float32", path)
    model = runner.model
    if kind == "qwen3_moe":
        assert isinstance(model.model.layers[0].mlp.experts.method, FusedMoEMethod)
        # get_weights_by_name reads an expert's matrix back from the stacked experts
        name = "model.layers.1.mlp.experts.5.up_proj.weight"
        assert torch.equal(weight_by_name(model, name), load_file(f"{path}/model.safetensors")[name])
    else:  # layers 0 and 2 slide over 8 positions, layer 1 attends to everything
        kinds = [type(layer.self_attn.attn) for layer in model.model.layers]
        assert kinds[0] is kinds[2] is SlidingWindowAttention and kinds[1] is not SlidingWindowAttention
    gen = torch.Generator().manual_seed(1)
    # a batch past the window from the first step, and a short prompt alone that starts inside it
    # (the backend's path) and leaves it while decoding (the windowed path)
    batches = [[torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 23, 40, 1)], [[5, 77, 301]]]
    hf = hf_model(path)
    outputs = []
    for prompts in batches:
        ours, ours_logits = greedy_generate(runner, prompts, NEW_TOKENS)
        for prompt, got, logits in zip(prompts, ours, ours_logits):
            want, want_logits = hf_greedy(hf, prompt, NEW_TOKENS)
            assert got == want
            torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=0)
            outputs.extend(got)
    assert len(set(outputs)) > 10  # not a degenerate constant output


def test_bf16_logits_close_to_transformers_fp32(tiny):
    """bf16 (native RMSNorm, rope and expert kernel where the CPU has them) teacher-forced along
    fp32 transformers' path: every step's logits within bf16's error of the fp32 ones."""
    _, path = tiny
    runner = runner_for("bfloat16", path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (7, 23, 40)]
    hf = hf_model(path)
    runs = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    _, logits = greedy_generate(runner, prompts, NEW_TOKENS, forced=[t for t, _ in runs])
    for got, (_, want) in zip(logits, runs):
        assert (got - want).abs().max() < 0.1 * want.abs().max()


def test_unsupported_variants_are_refused_by_name(tmp_path):
    import json

    make_tiny_checkpoint("gemma3", str(tmp_path))
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "attn_logit_softcapping": 50.0}))
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        runner_for("float32", str(tmp_path))
