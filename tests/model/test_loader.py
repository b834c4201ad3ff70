"""Model loading: GGUF metadata, llama.cpp's q/k permutation, dtype choice, pool sizing, tokenizer."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.model_loader import _unpermute_rope_rows, load_model
from pdserve.engine.model_source import resolve_model_path
from pdserve.engine.model_executor.model_runner import ModelRunner, cpu_supports_bf16, pool_num_pages, resolve_dtype
from pdserve.engine.mem_cache.page_pool import PagePool

torch.set_num_threads(1)


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, which the loader must undo."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(3 * 8, 5)
    permuted = llama_cpp_permute(w, 3)
    assert not torch.equal(permuted, w)
    assert torch.equal(_unpermute_rope_rows(permuted, 3), w)
    b = torch.randn(3 * 8)
    assert torch.equal(_unpermute_rope_rows(llama_cpp_permute(b, 3), 3), b)


def test_default_model_loads_fast_with_its_shape_and_tokenizer():
    start = time.process_time()  # CPU time: other jobs on the shared cores must not fail this
    runner = ModelRunner(EngineConfig(dtype="bfloat16", max_total_tokens=1024))
    assert time.process_time() - start < 10.0
    arch = runner.arch
    assert (arch.arch, arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (arch.head_dim, arch.vocab_size, arch.rope_theta, arch.tie_word_embeddings) == (64, 49152, 100000.0, True)
    assert runner.page_pool.max_total_tokens == 1024 and runner.page_pool.dtype == torch.bfloat16
    # bf16 on a bf16 CPU: weights prepacked for oneDNN (the tied lm_head is a packed copy)
    assert runner.model.plan.packed == cpu_supports_bf16()
    if not runner.model.plan.packed:  # the tied head reads the embedding's storage, no copy
        assert runner.model.lm_head.method.large.data_ptr() == runner.model.model.embed_tokens.weight.data_ptr()
    tok = runner.tokenizer
    assert tok.eos_token_id in arch.eos_token_ids
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(tok("Hello world").input_ids) == "Hello world"


def test_dtype_choice():
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if cpu_supports_bf16() else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_pool_sizing():
    arch = ModelArch("llama", 2, 64, 4, 2, 16, 128, 100, 1e4, 1e-5, 256, True)
    assert pool_num_pages(EngineConfig(max_total_tokens=160, page_size=16), arch, torch.float32, torch.device("cpu")) == 11
    # from free memory, but never more than max_running_requests full contexts
    capped = pool_num_pages(EngineConfig(max_running_requests=4, page_size=16), arch, torch.float32, torch.device("cpu"))
    assert capped == 4 * 256 // 16 + 1
    assert PagePool.bytes_per_token(2, 2, 16, torch.float32) * 4 * 256 < 1 << 30  # memory is not the bound here


def test_bad_paths_raise_value_errors_naming_model_path(tmp_path):
    with pytest.raises(ValueError, match="model_path '/nonexistent/x'"):
        resolve_model_path("/nonexistent/x")
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="model_path.*bad.gguf.*not a GGUF"):
        load_model(str(tmp_path / "bad.gguf"))
    assert resolve_model_path(None).format == "gguf"
