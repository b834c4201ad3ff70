"""The verify step as a decode step of expanded rows (``batch_builder.build_chain_verify_batch``).

On tiny random checkpoints, a verify batch whose sequences feed their last token and a draft
chain, presented as one single-token decode row per fed token, gives the logits of the same
tokens fed as an extend over the cached prefix (causal within the chain): equal in fp32, within
bf16's rounding and argmax-identical but for near ties in bf16 (where the rows take the fused
native decode step). The rows come in the order the scheduler loop reads them, and the K/V the
step leaves in the pool are the extend's.
"""

from __future__ import annotations

import pytest
import torch
from support.model_util import make_tiny_checkpoint, random_prompts

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.batch_builder import build_forward_batch
from pdserve.engine.sched.request import Req
from pdserve.engine.sched.scheduler import ForwardMode, ScheduledBatch

torch.set_num_threads(1)
PS = 4


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def ckpt(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"tiny_{request.param}_flat"))
    make_tiny_checkpoint(request.param, path)
    return path


def prefilled(runner: ModelRunner, prompts: list[list[int]], drafts: list[list[int]]) -> ScheduledBatch:
    """Requests whose prompts but the last token are in the pool (pages for the drafts too), and
    the decode batch that verifies ``drafts`` on them."""
    pool = runner.page_pool
    reqs = []
    for i, (p, d) in enumerate(zip(prompts, drafts)):
        req = Req(f"r{i}", p, SamplingParams(max_new_tokens=16, temperature=0.0))
        req.pages = pool.alloc(pool.pages_for(len(p) + len(d)))
        req.kv_len = len(p) - 1
        reqs.append(req)
    n = [r.kv_len for r in reqs]
    runner.forward(extend_batch(reqs, [0] * len(reqs), [r.input_ids[:-1] for r in reqs]))
    return ScheduledBatch(ForwardMode.DECODE, reqs, n, [1 + len(d) for d in drafts], [True] * len(reqs),
                          drafts=drafts)


def extend_batch(reqs: list[Req], starts: list[int], fed: list[list[int]]) -> ForwardBatch:
    """The tokens ``fed[i]`` from position ``starts[i]`` as one extend per sequence; every row's logits."""
    ids, pos, loc, lens = [], [], [], []
    for r, s, f in zip(reqs, starts, fed):
        ids += f
        pos += range(s, s + len(f))
        loc += [r.pages[p // PS] * PS + p % PS for p in range(s, s + len(f))]
        lens.append(s + len(f))
    width = max(len(r.pages) for r in reqs)
    table = torch.tensor([r.pages + [0] * (width - len(r.pages)) for r in reqs], dtype=torch.int32)
    return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(loc), table,
                        torch.arange(len(ids)), [len(f) for f in fed], lens)


def kv_of(runner: ModelRunner, fb: ForwardBatch) -> torch.Tensor:
    pool = runner.page_pool
    return torch.stack([torch.cat([pool.k_slots(i)[fb.out_cache_loc], pool.v_slots(i)[fb.out_cache_loc]])
                        for i in range(runner.arch.num_layers)]).float()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_expanded_rows_give_the_extend_logits(ckpt, dtype):
    runner = ModelRunner(EngineConfig(model_path=ckpt, dtype=dtype, max_total_tokens=1024, page_size=PS))
    prompts = random_prompts([6, 9, 3, 12], seed=3)
    drafts = [[7, 8], [], [9, 10, 11, 12], [13]]  # chains crossing page ends, one sequence without a draft
    batch = prefilled(runner, prompts, drafts)
    fb = build_forward_batch(batch, PS)
    rows = sum(1 + len(d) for d in drafts)
    assert fb.is_decode and fb.batch_size == rows and fb.logits_indices.tolist() == list(range(rows))
    assert fb.positions.tolist() == [r.kv_len + j for r, d in zip(batch.reqs, drafts) for j in range(1 + len(d))]
    assert fb.seq_lens == [p + 1 for p in fb.positions.tolist()]
    got = runner.forward(fb)
    got_kv = kv_of(runner, fb)
    want = runner.forward(extend_batch(batch.reqs, batch.prefix_lens,
                                       [r.input_ids[-1:] + d for r, d in zip(batch.reqs, drafts)]))
    want_kv = kv_of(runner, fb)
    assert got.shape == want.shape == (rows, runner.arch.vocab_size)
    if dtype == "float32":
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_kv, want_kv, atol=1e-5, rtol=1e-5)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    else:  # bf16 products of another row count: within a few ulps, picks equal but for near ties
        assert (got - want).abs().max() <= 0.05 * want.std()
        assert (got_kv - want_kv).abs().max() <= 0.05 * want_kv.abs().max()
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.02 * want.std()
        assert clear.any()
        assert (got.argmax(-1) == want.argmax(-1))[clear].all()
    for r in batch.reqs:
        runner.page_pool.free(r.pages)
