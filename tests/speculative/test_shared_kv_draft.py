"""The STANDALONE self-draft over the target's KV (``speculative/self_draft.py``), on a tiny llama (fp32).

- an exact copy of the target as the draft guesses the target's greedy continuation token for
  token, attending over the target's prompt KV (no catch-up) and holding no page of its own;
- the draft's K/V in the draft slots are overwritten by the verify forward: the committed KV is
  the target's exactly;
- through the scheduler loop, greedy output equals plain decoding's, pages are checked after
  every step;
- a batch whose draft slots do not fit reserves nothing and runs without drafts, never failing,
  and reserved pages the drafts do not use go back.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.model_util import greedy_generate, make_tiny_checkpoint, random_prompts

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.speculative.proposer import DraftInput
from pdserve.engine.speculative.registry import create_proposer
from pdserve.engine.speculative.self_draft import SharedKVDraftProposer

torch.set_num_threads(1)
PS = 4
K = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama_shared"))
    make_tiny_checkpoint("llama", path)
    return ModelRunner(EngineConfig(model_path=path, dtype="float32", max_total_tokens=512, page_size=PS))


def spec_config(target: ModelRunner, **kw) -> EngineConfig:
    return dataclasses.replace(target.config, speculative_algorithm="STANDALONE", speculative_num_draft_tokens=K,
                               **kw)


def prefill(runner: ModelRunner, prompt: list[int], extra: int) -> list[int]:
    """The prompt but its last token into fresh pages (room for ``extra`` more tokens); the pages."""
    pool = runner.page_pool
    pages = pool.alloc(pool.pages_for(len(prompt) + extra))
    n = len(prompt) - 1
    runner.forward(ForwardBatch(torch.tensor(prompt[:-1]), torch.arange(n),
                                torch.tensor([pages[p // PS] * PS + p % PS for p in range(n)]),
                                torch.tensor([pages], dtype=torch.int32), torch.tensor([n - 1]), [n], [n]))
    return pages


def test_an_exact_copy_guesses_the_targets_greedy_tokens_over_its_kv(target):
    proposer = create_proposer(spec_config(target), target)  # no draft path, no quantization: a copy
    assert isinstance(proposer, SharedKVDraftProposer) and proposer.pool is target.page_pool
    prompts = random_prompts([7, 13, 2], seed=5)
    want, _ = greedy_generate(target, prompts, K)
    pool = target.page_pool
    pages = [prefill(target, p, K + 1) for p in prompts]
    used = pool.num_used
    drafts = proposer.propose([DraftInput(f"r{i}", p, K, pages=pg, kv_len=len(p) - 1)
                               for i, (p, pg) in enumerate(zip(prompts, pages))])
    assert [d.tokens for d in drafts] == want
    assert pool.num_used == used  # nothing of its own
    with pytest.raises(ValueError, match="pages and kv_len"):
        proposer.propose([DraftInput("x", prompts[0], K)])
    for pg in pages:
        pool.free(pg)
    proposer.close()


def test_the_verify_overwrites_the_drafts_kv_with_the_targets(target):
    proposer = create_proposer(spec_config(target, speculative_draft_quantization="w8a16"), target)
    prompt = random_prompts([9], seed=2)[0]
    pool = target.page_pool
    pages = prefill(target, prompt, K + 1)
    start = len(prompt) - 1
    draft = proposer.propose([DraftInput("r", prompt, K, pages=pages, kv_len=start)])[0].tokens
    slots = torch.tensor([pages[p // PS] * PS + p % PS for p in range(start, start + K)])

    def kv() -> torch.Tensor:
        return torch.stack([torch.cat([pool.k_slots(i)[slots], pool.v_slots(i)[slots]]) for i in range(pool.num_layers)])

    drafted = kv()
    fed = [prompt[-1]] + draft[: K - 1]  # the verify of K - 1 drafts feeds the draft's K slots
    target.forward(ForwardBatch(torch.tensor(fed), torch.arange(start, start + K), slots,
                                torch.tensor([pages] * K, dtype=torch.int32), torch.arange(K), [1] * K,
                                list(range(start + 1, start + K + 1))))
    verified = kv()
    target.forward(ForwardBatch(torch.tensor(fed), torch.arange(start, start + K), slots,
                                torch.tensor([pages], dtype=torch.int32), torch.tensor([K - 1]), [K], [start + K]))
    torch.testing.assert_close(verified, kv(), atol=1e-5, rtol=1e-5)  # the target's, as an extend writes them
    assert (drafted - verified).abs().max() > 1e-4  # and not the int8 draft's
    pool.free(pages)
    proposer.close()


def test_greedy_through_the_loop_equals_plain_decoding(target):
    from pdserve.engine.messages import TokenizedGenerateReq
    from pdserve.engine.sched.scheduler_loop import SchedulerLoop
    from pdserve.engine.speculative.adaptive import AdaptiveRule

    prompts = random_prompts([5, 11, 8], seed=9)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    want, _ = greedy_generate(target, prompts, 12)
    cfg = spec_config(target, speculative_draft_quantization="w8a16")
    small = ModelRunner(dataclasses.replace(cfg, speculative_algorithm=None, speculative_draft_quantization=None))
    loop = SchedulerLoop(cfg, runner=small)
    assert loop.spec.shares_kv
    loop.spec.draft_cost = 0.0
    loop.spec.rule = AdaptiveRule(K)  # priced free: the tiny draft's step is all Python overhead
    for i, p in enumerate(prompts):
        loop.add_request(TokenizedGenerateReq(f"r{i}", p, params, stream=True))
    got: dict[str, list[int]] = {}
    while loop.has_work():
        for o in loop.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
        loop.check_integrity()
    assert [got[f"r{i}"] for i in range(3)] == want
    assert loop.spec.stats.verify_steps > 0
    assert loop.flush_cache()
    loop.spec.close()


def test_draft_slots_that_do_not_fit_reserve_nothing_and_unused_pages_go_back():
    from pdserve.engine.mem_cache.page_pool import PagePool
    from pdserve.engine.mem_cache.radix_cache import make_prefix_cache
    from pdserve.engine.sched.request import Req
    from pdserve.engine.sched.scheduler import ForwardMode, SampleOutput, Scheduler

    pool = PagePool(8, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)  # 7 pages
    config = EngineConfig(page_size=PS, speculative_algorithm="STANDALONE", speculative_num_draft_tokens=K,
                          num_reserved_decode_tokens=1)
    sched = Scheduler(config, pool, make_prefix_cache(pool, False), lambda req: None)
    reqs = [Req(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_new_tokens=20, temperature=0.0))
            for i, n in enumerate([6, 10])]
    for r in reqs:
        assert sched.add(r) is None
    batch = sched.schedule()  # the prefill
    sched.postprocess(batch, SampleOutput([1] * len(batch.reqs)))
    batch = sched.schedule()
    assert batch.mode == ForwardMode.DECODE
    before = [list(r.pages) for r in batch.reqs]
    free = pool.num_free
    assert sched.reserve_draft_pages(batch, [K, 40]) is None  # 40 slots: more than the pool
    assert [r.pages for r in batch.reqs] == before and pool.num_free == free
    held = sched.reserve_draft_pages(batch, [K, K])
    assert held == [len(p) for p in before] and pool.num_free < free
    # r0 keeps one draft, r1 none: r1's reserved pages go back, r0 keeps what its draft needs
    assert sched.attach_drafts(batch, [[5], []], held=held)
    assert len(batch.reqs[0].pages) == max(len(before[0]), pool.pages_for(batch.reqs[0].kv_len + 2))
    assert batch.reqs[1].pages == before[1]
    held = sched.reserve_draft_pages(batch, [K, K])
    assert not sched.attach_drafts(batch, [[], []], held=held)  # no drafts: every reserved page goes back
    assert [len(r.pages) for r in batch.reqs] == [len(p) for p in before]
    sched.check_integrity()
