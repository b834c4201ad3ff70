"""Decode steps through the graph runner (engine/model_executor/cuda_graph_runner.py) against eager
steps, on tiny random checkpoints.

On CPU the capture is ``eager_capture``: every step runs on the runner's static buffers, padded to
its bucket, with the attention backend's graph metadata, which is all a CUDA graph adds to a step
but the recording. The last test records real CUDA graphs and runs only where CUDA is."""

from __future__ import annotations

import pytest
import torch
from support.model_util import assert_picks_agree_but_near_ties, greedy_generate, make_tiny_checkpoint, random_prompts

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.cuda_graph_runner import (DecodeGraphRunner, bucket_for, decode_buckets,
                                                             eager_capture)
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.model_executor.attention.torch_backend import TorchAttentionBackend

torch.set_num_threads(1)
NEW = 8
MAX_BS = 8


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert decode_buckets(64) == [1, 2, 4, *range(8, 65, 8)]
    assert decode_buckets(5) == [1, 2, 4, 5]
    assert decode_buckets(1) == [1]
    buckets = decode_buckets(20)
    assert buckets == [1, 2, 4, 8, 16, 20]
    assert [bucket_for(bs, buckets) for bs in (1, 3, 4, 5, 16, 17, 20)] == [1, 4, 4, 8, 16, 20, 20]
    for bad in (0, 21):
        with pytest.raises(ValueError, match="outside the captured buckets"):
            bucket_for(bad, buckets)
    with pytest.raises(ValueError, match="max_bs"):
        decode_buckets(0)
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=-1)


def graph_runner(runner: ModelRunner, native: bool) -> DecodeGraphRunner:
    """``runner`` with its steps through a graph runner of eager captures; ``native``: the native
    decode attention (and fused step), else the torch path, which masks the static table's width."""
    if not native:
        arch = runner.arch
        runner.attn_backend = TorchAttentionBackend(runner.page_pool, arch.num_heads, arch.num_kv_heads,
                                                    arch.head_dim, arch.head_dim**-0.5, use_native=False)
    assert runner.graph_runner is None  # CPU: none captured by default
    max_pages = -(-runner.arch.max_context_len // runner.page_pool.page_size)
    graphs = DecodeGraphRunner(runner.model, runner.attn_backend, MAX_BS, max_pages, eager_capture)
    assert graphs.buckets == [1, 2, 4, 8]
    return graphs


@pytest.mark.parametrize("dtype,native", [("float32", False), ("float32", True), ("bfloat16", True)])
def test_graph_steps_give_the_eager_tokens(ckpt, dtype, native):
    runner = ModelRunner(EngineConfig(model_path=ckpt, dtype=dtype, max_total_tokens=2048, page_size=4))
    graphs = graph_runner(runner, native)
    # every bucket, and ragged batches padded into the next one; prompts of ragged lengths
    for bs in (1, 2, 3, 4, 5, 8):
        prompts = random_prompts([2 + 7 * i for i in range(bs)], seed=bs)
        runner.graph_runner = None
        want_tokens, want = greedy_generate(runner, prompts, NEW)
        runner.graph_runner = graphs
        before = sum(graphs.replays.values())
        tokens, got = greedy_generate(runner, prompts, NEW, forced=want_tokens)
        assert graphs.replays[bucket_for(bs, graphs.buckets)] >= NEW - 1  # every decode step replayed
        assert sum(graphs.replays.values()) - before == NEW - 1
        for g, w in zip(got, want):
            if dtype == "float32":
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
            else:  # bf16 products of another row count: within a few ulps of the activations
                assert (g - w).abs().max() <= 0.05 * w.std(), (bs, (g - w).abs().max(), w.std())
        if dtype == "float32":
            assert tokens == want_tokens, bs
        else:
            assert_picks_agree_but_near_ties(tokens, want_tokens, want)


@pytest.mark.parametrize("native", [False, True])
def test_padding_rows_write_only_the_scratch_page(tmp_path, native):
    make_tiny_checkpoint("llama", str(tmp_path))
    runner = ModelRunner(EngineConfig(model_path=str(tmp_path), dtype="float32", max_total_tokens=256, page_size=4))
    graphs = graph_runner(runner, native)
    pool = runner.page_pool
    gen = torch.Generator().manual_seed(0)
    for layer in range(pool.num_layers):
        pool.k[layer].normal_(generator=gen)
        pool.v[layer].normal_(generator=gen)
    # three sequences of 5, 9 and 2 tokens run in the bucket of 4: one padding row
    lens = [5, 9, 2]
    pages = [[1, 2], [3, 4, 5], [6]]
    table = torch.zeros(3, 3, dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = torch.tensor(p)
    loc = torch.tensor([p[(n - 1) // 4] * 4 + (n - 1) % 4 for p, n in zip(pages, lens)])
    batch = ForwardBatch(torch.tensor([5, 6, 7]), torch.tensor(lens) - 1, loc, table, torch.arange(3),
                         [1, 1, 1], lens)
    k0 = [k.clone() for k in pool.k]
    runner.graph_runner = None
    want = runner.forward(batch)
    k_eager = [k.clone() for k in pool.k]
    for k, k_before in zip(pool.k, k0):
        k.copy_(k_before)
    runner.graph_runner = graphs
    got = runner.forward(batch)
    assert graphs.replays == {4: 1}
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    ps, dim = pool.page_size, pool.head_dim
    for k, k_before, k_want in zip(pool.k, k0, k_eager):
        changed = (k != k_before).any(dim=-1).any(dim=0).reshape(-1)  # [num_slots]
        written = set(changed.nonzero().flatten().tolist())
        assert set(loc.tolist()) <= written  # the real rows' new keys
        assert written - set(loc.tolist()) <= set(range(ps))  # and padding only in page 0
        # the real rows' keys as eager wrote them (products of 4 rows rather than 3: ulps apart)
        planes, planes_want = k.view(k.shape[0], -1, dim), k_want.view(k.shape[0], -1, dim)
        torch.testing.assert_close(planes[:, loc], planes_want[:, loc], atol=1e-5, rtol=1e-5)


def verify_batch(runner: ModelRunner, prompts: list[list[int]], drafts: list[list[int]]):
    """Requests with their prompts but the last token cached, and the decode batch verifying
    ``drafts`` on them as expanded rows (``batch_builder.build_chain_verify_batch``)."""
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sched.batch_builder import build_chain_verify_batch
    from pdserve.engine.sched.request import Req
    from pdserve.engine.sched.scheduler import ForwardMode, ScheduledBatch

    pool, ps = runner.page_pool, runner.page_pool.page_size
    reqs = []
    for i, (p, d) in enumerate(zip(prompts, drafts)):
        req = Req(f"r{i}", p, SamplingParams(max_new_tokens=16, temperature=0.0))
        req.pages, req.kv_len = pool.alloc(pool.pages_for(len(p) + len(d))), len(p) - 1
        reqs.append(req)
    width = max(len(r.pages) for r in reqs)
    prefill = ForwardBatch(
        torch.tensor([t for r in reqs for t in r.input_ids[:-1]]),
        torch.cat([torch.arange(r.kv_len) for r in reqs]),
        torch.tensor([r.pages[q // ps] * ps + q % ps for r in reqs for q in range(r.kv_len)]),
        torch.tensor([r.pages + [0] * (width - len(r.pages)) for r in reqs], dtype=torch.int32),
        torch.tensor([r.kv_len for r in reqs]).cumsum(0) - 1, [r.kv_len for r in reqs], [r.kv_len for r in reqs])
    runner.forward(prefill)
    batch = ScheduledBatch(ForwardMode.DECODE, reqs, [r.kv_len for r in reqs], [1 + len(d) for d in drafts],
                           [True] * len(reqs), drafts=drafts)
    return build_chain_verify_batch(batch, ps)


@pytest.mark.parametrize("native", [False, True])
def test_a_verify_step_replays_from_the_bucket_of_its_rows(tmp_path, native):
    make_tiny_checkpoint("llama", str(tmp_path))
    runner = ModelRunner(EngineConfig(model_path=str(tmp_path), dtype="float32", max_total_tokens=256, page_size=4))
    graphs = graph_runner(runner, native)
    # 2 + 1 + 3 = 6 rows (one sequence without a draft) in the bucket of 8
    fb = verify_batch(runner, random_prompts([5, 8, 3], seed=1), [[7], [], [9, 10]])
    runner.graph_runner = None
    want = runner.forward(fb)
    runner.graph_runner = graphs
    got = runner.forward(fb)
    assert graphs.replays == {8: 1} and got.shape == (6, runner.arch.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records CUDA graphs: needs a CUDA device")
def test_cuda_graph_steps_give_the_eager_tokens(ckpt):
    kw = dict(model_path=ckpt, dtype="float32", max_total_tokens=2048, page_size=4, device="cuda",
              cuda_graph_max_bs=MAX_BS)
    graphs = ModelRunner(EngineConfig(**kw))
    eager = ModelRunner(EngineConfig(**kw, disable_cuda_graph=True))
    assert graphs.graph_runner is not None and eager.graph_runner is None
    for bs in (1, 3, 8):
        prompts = random_prompts([2 + 7 * i for i in range(bs)], seed=bs)
        want_tokens, want = greedy_generate(eager, prompts, NEW)
        tokens, got = greedy_generate(graphs, prompts, NEW)
        assert tokens == want_tokens
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w.cpu(), atol=1e-3, rtol=1e-3)
    assert sum(graphs.graph_runner.replays.values()) == 3 * (NEW - 1)
