"""The STANDALONE proposer (``engine/speculative/draft_model.py``) on its own, against the target's
plain greedy decoding: a full-precision self-draft guesses exactly the target's continuation, a
rejection rolls the draft's KV back to what a fresh proposer would hold, a full pool gives empty
drafts rather than errors, released requests give every page back, and a draft of another
vocabulary is refused naming the flag. The w8a16 self-draft of the default model is measured
against the bf16 target's greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.model_util import greedy_generate, make_tiny_checkpoint, random_prompts

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.speculative.draft_model import DraftModelProposer, common_prefix_len
from pdserve.engine.speculative.proposer import Draft, DraftInput

torch.set_num_threads(1)
PAGE = 4
K = 4  # speculative_num_draft_tokens


def tiny_config(path: str, **kw) -> EngineConfig:
    base = dict(model_path=path, dtype="float32", max_total_tokens=512, page_size=PAGE, max_running_requests=4,
                speculative_algorithm="STANDALONE", speculative_num_draft_tokens=K)
    return EngineConfig(**{**base, **kw})


def target_of(config: EngineConfig) -> ModelRunner:
    return ModelRunner(dataclasses.replace(config, speculative_algorithm=None, speculative_draft_model_path=None,
                                           speculative_draft_quantization=None))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(config, target runner, self-draft proposer) over a tiny random llama, float32."""
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    make_tiny_checkpoint("llama", path)
    config = tiny_config(path)
    target = target_of(config)
    return config, target, DraftModelProposer(config, target)


@pytest.mark.parametrize("a,b,n", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
                                   ([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], 2), ([7], [8], 0)])
def test_common_prefix_len(a, b, n):
    assert common_prefix_len(a, b) == common_prefix_len(b, a) == n


def test_self_draft_guesses_the_targets_greedy_continuation(tiny):
    config, target, proposer = tiny
    prompts = random_prompts([5, 13, 9], seed=1)
    want, _ = greedy_generate(target, prompts, 12)
    rids = ["a", "b", "c"]
    # round 1: the prompts alone (the first call prefills the draft), several draft lengths in one batch
    drafts = proposer.propose([DraftInput(r, p, k) for r, p, k in zip(rids, prompts, [4, 3, 1])])
    assert [d.tokens for d in drafts] == [want[0][:4], want[1][:3], want[2][:1]]
    assert drafts[0].parents == [-1, 0, 1, 2]
    # round 2: all of a's guesses accepted plus the bonus; two of b's plus the bonus; c one token on
    inputs = [prompts[0] + want[0][:5], prompts[1] + want[1][:3], prompts[2] + want[2][:1]]
    drafts = proposer.propose([DraftInput(r, ids, K) for r, ids in zip(rids, inputs)])
    assert [d.tokens for d in drafts] == [want[0][5:9], want[1][3:7], want[2][1:5]]
    proposer.check_integrity()
    for rid in rids:
        proposer.release(rid)


def test_a_rejection_rolls_back_to_what_a_fresh_proposer_guesses(tiny):
    config, target, proposer = tiny
    prompt = random_prompts([10], seed=2)[0]
    first = proposer.propose([DraftInput("r", prompt, K)])[0].tokens
    # the target rejected the second guess and picked another token there
    other = (first[1] + 1) % 512
    diverged = prompt + [first[0], other]
    rolled = proposer.propose([DraftInput("r", diverged, K)])[0]
    fresh = DraftModelProposer(config, target)
    try:
        assert rolled == fresh.propose([DraftInput("r", diverged, K)])[0]
        assert len(rolled.tokens) == K
        # what the draft now holds: the 12 tokens fed and 3 of its 4 guesses, in their pages only
        assert proposer.pool.num_used == proposer.pool.pages_for(len(diverged) + K - 1)
        proposer.check_integrity()
        # a shorter history than the draft has seen (a request restarted): rolled back as well
        assert proposer.propose([DraftInput("r", prompt, K)])[0].tokens == first
    finally:
        fresh.close()
        proposer.release("r")
    assert proposer.pool.num_used == 0


def test_a_long_prompt_is_caught_up_over_several_calls(tiny):
    _, target, proposer = tiny
    prompt = random_prompts([300], seed=5)[0]  # past the 256 tokens one call catches up
    want, _ = greedy_generate(target, [prompt], K)
    short = random_prompts([6], seed=6)[0]
    first = proposer.propose([DraftInput("long", prompt, K), DraftInput("short", short, K)])
    assert first[0] == Draft() and len(first[1].tokens) == K  # the short one drafts meanwhile
    assert proposer.propose([DraftInput("long", prompt, K)])[0].tokens == want[0]
    proposer.check_integrity()
    proposer.release("long")
    proposer.release("short")


def test_release_frees_every_page(tiny):
    _, _, proposer = tiny
    prompts = random_prompts([7, 30, 2], seed=3)
    proposer.propose([DraftInput(f"r{i}", p, K) for i, p in enumerate(prompts)])
    assert proposer.num_requests == 3 and proposer.pool.num_used > 0
    proposer.check_integrity()
    for i in range(3):
        proposer.release(f"r{i}")
    proposer.release("never-seen")
    assert proposer.num_requests == 0 and proposer.pool.num_used == 0
    proposer.check_integrity()


def test_a_full_pool_gives_empty_drafts_not_errors(tiny):
    config, _, _ = tiny
    # the draft's pool follows the target's: 64 tokens + 1 request x (4 drafts + a page) = 18 pages
    small = dataclasses.replace(config, max_total_tokens=64, max_running_requests=1)
    proposer = DraftModelProposer(small, target_of(small))
    assert proposer.pool.capacity == 18
    prompts = random_prompts([30, 30, 30], seed=4)  # 33 slots each: 9 pages, two fit
    drafts = proposer.propose([DraftInput(f"r{i}", p, K) for i, p in enumerate(prompts)])
    assert [len(d.tokens) for d in drafts] == [K, K, 0]
    assert drafts[2] == Draft()
    proposer.check_integrity()
    proposer.release("r0")
    assert len(proposer.propose([DraftInput("r2", prompts[2], K)])[0].tokens) == K
    proposer.close()
    assert proposer.pool.num_used == 0


def test_a_draft_of_another_tokenizer_is_refused_naming_the_flag(tiny, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config, target, _ = tiny
    other = str(tmp_path / "other")
    make_tiny_checkpoint("qwen2", other)  # the same 512 ids, which name other words below
    vocab = {f"t{i}": (i * 7) % 512 for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2").save_pretrained(other)
    with pytest.raises(ValueError, match="speculative_draft_model_path.*another tokenizer"):
        DraftModelProposer(dataclasses.replace(config, speculative_draft_model_path=other), target)


def test_a_draft_that_cannot_load_raises_at_construction(tiny, tmp_path):
    config, target, _ = tiny
    with pytest.raises(Exception):
        DraftModelProposer(dataclasses.replace(config, speculative_draft_model_path=str(tmp_path / "none")), target)


# measured on the 16 chat prompts below, 4 draft tokens, 48 new tokens each (2026-12-02): 0.87 of
# the w8a16 self-draft's tokens were the bf16 target's greedy picks
W8A16_ACCEPT_BOUND = 0.75
CHATS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
         "Why is the sky blue?"]


def test_w8a16_self_draft_of_the_default_model_mostly_agrees_with_the_target(tiny):
    """Speculation simulated against the bf16 target's greedy continuation: each step the draft
    guesses K tokens, the longest run equal to the target's is accepted, plus the target's next."""
    config = EngineConfig(dtype="bfloat16", max_total_tokens=2048, max_running_requests=8,
                          speculative_algorithm="STANDALONE", speculative_draft_quantization="w8a16")
    target = target_of(config)
    proposer = DraftModelProposer(config, target)
    # a draft of the tiny model's vocabulary refused by the default model (the sizes differ)
    with pytest.raises(ValueError, match="speculative_draft_model_path.*vocabulary of 512"):
        DraftModelProposer(dataclasses.replace(config, speculative_draft_model_path=tiny[0].model_path), target)
    tok = target.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids
               for q in CHATS]
    new = 32
    want, _ = greedy_generate(target, prompts, new)
    done = [0] * len(prompts)  # target tokens known to each request
    proposed = accepted = 0
    while any(d < new for d in done):
        live = [i for i in range(len(prompts)) if done[i] < new]
        drafts = proposer.propose([DraftInput(str(i), prompts[i] + want[i][:done[i]], K) for i in live])
        for i, draft in zip(live, drafts):
            run = 0
            while run < len(draft.tokens) and done[i] + run < new and draft.tokens[run] == want[i][done[i] + run]:
                run += 1
            proposed += len(draft.tokens)
            accepted += run
            done[i] += run + 1
    for i in range(len(prompts)):
        proposer.release(str(i))
    assert proposer.pool.num_used == 0
    rate = accepted / proposed
    print(f"w8a16 self-draft: {accepted} of {proposed} draft tokens accepted ({rate:.2f}); a draft step "
          f"costs {proposer.cost_per_token:.2f} of the target's")
    assert proposer.cost_per_token > 0
    assert rate >= W8A16_ACCEPT_BOUND


# ------------------------------------------------------- through the scheduler (spec-core's verify)
def loop_generate(target, reqs, **spec):
    """Run ``reqs`` (rid, prompt, SamplingParams) to the end in a fresh SchedulerLoop over ``target``;
    (tokens per rid, the loop). The pool is checked after every step and flushed at the end. With
    speculation the adaptive rule prices drafts as free: the tiny draft's step costs about the
    target's (all Python overhead), and priced so, it would rightly never speculate."""
    from pdserve.engine.messages import TokenizedGenerateReq
    from pdserve.engine.sched.scheduler_loop import SchedulerLoop
    from pdserve.engine.speculative.adaptive import AdaptiveRule

    cfg = EngineConfig(model_path=target.config.model_path, dtype="float32", max_total_tokens=512, page_size=PAGE,
                       **spec)
    loop = SchedulerLoop(cfg, runner=target)
    if loop.spec is not None:
        assert loop.spec.draft_cost == loop.spec.proposer.cost_per_token > 0
        loop.spec.draft_cost = 0.0
        loop.spec.rule = AdaptiveRule(cfg.speculative_num_draft_tokens)
    for rid, prompt, params in reqs:
        loop.add_request(TokenizedGenerateReq(rid, prompt, params, stream=True))
    tokens: dict[str, list[int]] = {}
    while loop.has_work():
        for o in loop.step():
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
        loop.check_integrity()
    assert loop.flush_cache()
    return tokens, loop


def test_standalone_greedy_equals_plain_decoding(tiny, tmp_path):
    """Greedy tokens with STANDALONE are plain decoding's: a w8a16 self-draft (mostly right) and a
    draft of other weights with the same tokenizer (mostly wrong), stops and max_tokens included;
    every draft page is back when the requests end."""
    from pdserve.engine.sampling_params import SamplingParams

    _, target, _ = tiny
    other = str(tmp_path / "qwen2")
    make_tiny_checkpoint("qwen2", other)
    prompts = random_prompts([5, 11, 8], seed=7)
    free, _ = loop_generate(target, [(f"f{i}", p, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
                                      for i, p in enumerate(prompts)])
    reqs = []
    for i, p in enumerate(prompts):
        out = free[f"f{i}"]
        reqs += [(f"len{i}", p, SamplingParams(max_new_tokens=19, temperature=0.0, ignore_eos=True)),
                 (f"tok{i}", p, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=[out[10]]))]
    plain, _ = loop_generate(target, reqs)
    for spec, accepted in ((dict(speculative_draft_quantization="w8a16"), True),
                           (dict(speculative_draft_model_path=other), False)):
        got, loop = loop_generate(target, reqs, speculative_algorithm="STANDALONE", **spec)
        assert got == plain, spec
        stats, proposer = loop.spec.stats, loop.spec.proposer
        assert stats.verify_steps > 0 and (stats.accepted > stats.proposed // 2) == accepted, (spec, stats)
        assert proposer.pool.num_used == 0 and proposer.num_requests == 0
        proposer.check_integrity()
        loop.spec.close()
