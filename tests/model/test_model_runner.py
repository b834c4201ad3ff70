"""ModelRunner steps that the scheduler produces besides plain prefill/decode: chunked prefill
(a middle chunk samples nothing, the next attends over the cached prefix) and mixed batches
(decode rows and prefill rows together). Each must give the logits of the simple path."""

from __future__ import annotations

import pytest
import torch
from support.model_util import make_tiny_checkpoint

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_runner import ModelRunner

torch.set_num_threads(1)
PAGE = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_tiny_checkpoint("llama", path)
    return ModelRunner(EngineConfig(model_path=path, dtype="float32", max_total_tokens=512, page_size=PAGE))


def step(runner, seqs, sample):
    """seqs: list of (pages, prefix_len, new token ids); sample[i]: whether seq i's last row gets logits."""
    ids, pos, loc, logits_rows = [], [], [], []
    width = max(len(p) for p, _, _ in seqs)
    page_table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (pages, prefix, new) in enumerate(seqs):
        page_table[i, : len(pages)] = torch.tensor(pages)
        for j, t in enumerate(new):
            p = prefix + j
            ids.append(t)
            pos.append(p)
            loc.append(pages[p // PAGE] * PAGE + p % PAGE)
        if sample[i]:
            logits_rows.append(len(ids) - 1)
    return runner.forward(ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos), out_cache_loc=torch.tensor(loc),
        page_table=page_table, logits_indices=torch.tensor(logits_rows, dtype=torch.int64),
        extend_lens=[len(n) for _, _, n in seqs], seq_lens=[pre + len(n) for _, pre, n in seqs],
    ))


def test_chunked_prefill_and_mixed_batch_give_the_simple_path_logits(runner):
    pool = runner.page_pool
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 512, (37,), generator=gen).tolist()
    other = torch.randint(3, 512, (11,), generator=gen).tolist()

    a = pool.alloc(pool.pages_for(40))
    whole = step(runner, [(a, 0, prompt)], [True])[0]  # one prefill
    nxt = int(whole.argmax())
    after = step(runner, [(a, 37, [nxt])], [True])[0]  # one decode
    alone = step(runner, [(pool.alloc(pool.pages_for(11)), 0, other)], [True])[0]

    b = pool.alloc(pool.pages_for(40))
    middle = step(runner, [(b, 0, prompt[:22])], [False])  # first chunk samples nothing
    assert middle.shape == (0, runner.arch.vocab_size)
    chunked = step(runner, [(b, 22, prompt[22:])], [True])[0]  # second chunk over a 22-token prefix
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)

    c = pool.alloc(pool.pages_for(11))
    mixed = step(runner, [(b, 37, [nxt]), (c, 0, other)], [True, True])  # decode row + prefill rows
    torch.testing.assert_close(mixed[0], after, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(mixed[1], alone, atol=1e-4, rtol=1e-4)
    assert int(after.argmax()) == int(mixed[0].argmax())


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])  # q/k/v bias and q/k norm through the packed path
def test_prepacked_bf16_linears_match_plain_ones(kind, tmp_path):
    from pdserve.engine.model_executor.model_loader import load_model
    from pdserve.engine.model_executor.model_runner import cpu_supports_bf16
    from pdserve.engine.model_executor.layers import can_prepack
    from pdserve.engine.model_executor.models.registry import build_model
    from pdserve.engine.mem_cache.page_pool import PagePool
    from pdserve.engine.model_executor.attention.torch_backend import TorchAttentionBackend

    if not can_prepack(torch.bfloat16, torch.device("cpu"), cpu_supports_bf16()):
        pytest.skip("no oneDNN bf16 prepacking on this CPU")
    make_tiny_checkpoint(kind, str(tmp_path))
    arch, weights, _ = load_model(str(tmp_path))
    n = 20
    batch = ForwardBatch(torch.arange(3, 3 + n), torch.arange(n), torch.arange(16, 16 + n),
                         torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([n - 1]), [n], [n])
    outs = []
    for packed in (False, True):
        model = build_model(arch, weights, torch.bfloat16, torch.device("cpu"), prepack=packed)
        pool = PagePool(4, 16, arch.num_layers, arch.num_kv_heads, arch.head_dim, torch.bfloat16)
        backend = TorchAttentionBackend(pool, arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.head_dim**-0.5)
        backend.begin_forward(batch)
        with torch.inference_mode():
            outs.append(model.forward(batch, backend)[0])
    assert outs[0].abs().max() > 1.0  # logits of some size, so the tolerance below means something
    torch.testing.assert_close(outs[1], outs[0], atol=0.1, rtol=0.05)  # bf16 rounding of fused post-ops
    assert int(outs[1].argmax()) == int(outs[0].argmax())
