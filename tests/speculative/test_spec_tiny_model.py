"""Speculation in a colocated scheduler loop on a tiny random checkpoint (fp32, in-process).

Greedy outputs equal plain decoding's token for token, with NGRAM and with a proposer whose drafts
are right for a random length and then wrong (``oracle.py``), including requests that end on a stop
token, a stop string, EOS or max_tokens inside an accepted run; sampled requests run with drafts;
a regex grammar is never broken by a draft; the pool is checked after every step.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from support.model_util import make_tiny_checkpoint

from pdserve.engine.config import EngineConfig
from pdserve.engine.messages import TokenizedGenerateReq
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.scheduler_loop import SchedulerLoop
from pdserve.engine.speculative.proposer import Draft
from pdserve.engine.speculative.verify import accept_sampled, step_uniforms, target_probs

from oracle import FREE_RULE, OracleProposer
from test_verify import chi2, chi2_critical

torch.set_num_threads(1)


BASE = dict(dtype="float32", max_total_tokens=1024, page_size=4)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llama_spec"))
    make_tiny_checkpoint("llama", path)
    return ModelRunner(EngineConfig(model_path=path, **BASE))


def generate(runner, reqs: list[tuple[str, list[int], SamplingParams]], spec: str | None = None, proposer=None):
    """Run ``reqs`` to the end in a fresh loop over ``runner``; (tokens, final outputs, loop)."""
    cfg = EngineConfig(model_path=runner.config.model_path, speculative_algorithm=spec, **BASE)
    loop = SchedulerLoop(cfg, runner=runner)
    if spec is not None:  # what is checked here is the verify step: every draft is verified
        loop.spec.rule = FREE_RULE()
    if proposer is not None:
        loop.spec.proposer = proposer
    for rid, prompt, params in reqs:
        loop.add_request(TokenizedGenerateReq(rid, prompt, params, stream=True))
    tokens: dict[str, list[int]] = {}
    finals = {}
    while loop.has_work():
        for o in loop.step():
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.rid] = o
        loop.check_integrity()
    assert loop.flush_cache()  # the next loop over this runner's pool starts from a free pool
    assert runner.page_pool.num_free == runner.page_pool.capacity
    return tokens, finals, loop


def prompts(n: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rnd.randrange(3, 512) for _ in range(4 + i)]
        out.append(motif * 3 + [rnd.randrange(3, 512)])  # copies for NGRAM to find
    return out


def greedy(max_new: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)


def test_ngram_greedy_equals_plain_decoding(runner):
    reqs = [(f"r{i}", p, greedy(24, ignore_eos=True)) for i, p in enumerate(prompts(3, 0))]
    plain, _, _ = generate(runner, reqs)
    spec, finals, loop = generate(runner, reqs, "NGRAM")
    assert spec == plain
    assert loop.spec.stats.verify_steps > 0
    assert all(f.spec_verify_ct > 0 for f in finals.values())


def test_stops_inside_accepted_runs_equal_plain_decoding(runner):
    ps = prompts(4, 1)
    free = [(f"f{i}", p, greedy(30, ignore_eos=True)) for i, p in enumerate(ps)]
    truth, _, _ = generate(runner, free)
    tok = runner.tokenizer
    reqs = []
    for i, p in enumerate(ps):
        out = truth[f"f{i}"]
        reqs += [
            (f"tok{i}", p, greedy(30, stop_token_ids=[out[11]], ignore_eos=True)),  # a stop token mid-run
            (f"str{i}", p, greedy(30, stop=[tok.decode(out[9:11])], ignore_eos=True)),  # a stop string
            (f"eos{i}", p, greedy(30)),  # EOS (2) where the model emits it
            (f"len{i}", p, greedy(13, ignore_eos=True)),  # max_tokens not on a draft boundary
        ]
    plain, plain_finals, _ = generate(runner, reqs)
    truth_full = {rid: p + truth[f"f{rid[-1]}"] for rid, p, _ in reqs}
    oracle = OracleProposer(truth_full, seed=3)
    spec, finals, loop = generate(runner, reqs, "NGRAM", proposer=oracle)
    assert spec == plain
    for rid in plain:
        assert (finals[rid].finish_reason, finals[rid].matched_stop) == (
            plain_finals[rid].finish_reason, plain_finals[rid].matched_stop)
    assert any(len(plain[f"tok{i}"]) < 30 for i in range(4))  # the stops did stop early
    assert loop.spec.stats.accepted > 20 and loop.spec.stats.proposed > loop.spec.stats.accepted


def test_sampled_requests_run_with_drafts_and_seeds_repeat(runner):
    p = prompts(1, 2)[0]
    reqs = [(f"s{i}", p, SamplingParams(max_new_tokens=20, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True))
            for i in range(2)]  # n = 2 with one seed: the same tokens
    reqs.append(("u", p, SamplingParams(max_new_tokens=20, temperature=1.0, top_k=20, ignore_eos=True)))
    # NGRAM's drafts are a function of the tokens, so one seed gives one output with speculation too
    spec, finals, loop = generate(runner, reqs, "NGRAM")
    assert spec["s0"] == spec["s1"] and len(spec["s0"]) == 20 and len(spec["u"]) == 20
    assert finals["s0"].spec_verify_ct > 0 and finals["u"].spec_verify_ct > 0


def test_rejection_sampling_keeps_the_tiny_models_distribution(runner):
    """The target rows of a real verify forward; draws with a point-mass draft match them (chi-square)."""
    prompt = prompts(1, 4)[0]
    pool = runner.page_pool
    pages = pool.alloc(pool.pages_for(len(prompt) + 3))
    from pdserve.engine.mem_cache.forward_batch import ForwardBatch

    n = len(prompt)
    seq = prompt + [5, 6]  # the fed token, then two drafts
    fb = ForwardBatch(torch.tensor(seq), torch.arange(n + 2), torch.tensor([pages[p // 4] * 4 + p % 4 for p in range(n + 2)]),
                      torch.tensor([pages], dtype=torch.int32), torch.tensor([n - 1, n, n + 1]), [n + 2], [n + 2])
    logits = runner.forward(fb)
    pool.free(pages)
    probs = target_probs(logits, 1.0, -1, 1.0, 0.0)
    draft = [int(probs[0].argmax()), 6]
    rng = random.Random(0)
    counts = torch.zeros(probs.shape[1])
    trials = 6000
    for _ in range(trials):
        counts[accept_sampled(probs, draft, step_uniforms(None, 0, 3, rng))[0]] += 1
    stat, df = chi2(counts, probs[0], trials)
    assert stat < chi2_critical(df), (stat, df)


class FixedProposer:
    """Proposes the same tokens to every request: here mostly tokens the grammar forbids."""

    name, wants_hidden = "FIXED", False

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, inputs):
        return [Draft.chain(self.tokens[: i.max_tokens]) for i in inputs]

    def release(self, rid):
        pass

    def close(self):
        pass


def test_regex_grammar_is_never_broken_by_drafts(runner):
    pattern = "t(3|4|5)t(3|4|5)t(3|4|5)t(6|7)"
    p = prompts(1, 5)[0]
    reqs = [(f"g{i}", p, SamplingParams(max_new_tokens=12, temperature=t, regex=pattern, seed=i))
            for i, t in enumerate((0.0, 0.0, 1.0, 1.0))]
    plain, _, _ = generate(runner, reqs)
    spec, finals, loop = generate(runner, reqs, "NGRAM", proposer=FixedProposer([3, 6, 4, 5, 7]))
    for rid in ("g0", "g1"):
        assert spec[rid] == plain[rid]
    for rid, toks in spec.items():
        text = "".join(runner.tokenizer.convert_ids_to_tokens(t) for t in toks if t != 2)
        assert re.fullmatch(pattern, text), (rid, text)
        assert finals[rid].finish_reason == "stop"
    assert loop.spec.stats.verify_steps > 0
