"""TP 2: both ranks of a tensor-parallel group run the colocated loop with speculation over their
shard, fed the same requests (as rank 0's broadcast feeds them in a server), in two real processes
joined by gloo: NGRAM (with draft trees), and STANDALONE with the w8a16 self-draft and with a draft
checkpoint of its own (both sharded in the ranks' TP group). Every rank proposes the same drafts and
accepts the same tokens, greedy and sampled (seeded or not); greedy outputs equal plain decoding's
at TP 2 and at TP 1; both ranks price a draft token alike (the largest rank's measured cost); every
page of both ranks' target and draft pools is back at the end."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch
from support.model_util import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)

# the third: "5 9 12" followed by three different tokens, so NGRAM drafts trees (several branches)
PROMPTS = [[1] + [17, 250, 3, 99] * 4, [4, 4, 8, 15, 16, 23, 42] * 2,
           [5, 9, 12, 200, 31, 5, 9, 12, 77, 31, 5, 9, 12, 140, 31, 5, 9, 12]]
BASE = dict(dtype="float32", max_total_tokens=1024, page_size=4, num_threads=1)
PARAMS = [
    dict(max_new_tokens=14, temperature=0.0, ignore_eos=True),
    dict(max_new_tokens=14, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    dict(max_new_tokens=14, temperature=1.0, ignore_eos=True),  # unseeded: the rank's generator
]


def variants(draft_path: str) -> dict[str, dict]:
    return {"plain": {}, "NGRAM": dict(speculative_algorithm="NGRAM", speculative_ngram_branches=2),
            "W8A16": dict(speculative_algorithm="STANDALONE", speculative_draft_quantization="w8a16"),
            "DRAFT": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft_path)}


def run_loop(config, runner, spec: bool):
    """Every request of PROMPTS x PARAMS to the end in a fresh loop over ``runner``, the pool checked
    after every step: (tokens per rid, (verify steps, drafts verified, accepted), the drafts proposed
in order, the price of a draft token, the verify steps that carried a tree)."""
    from pdserve.engine.messages import TokenizedGenerateReq
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sched.scheduler_loop import SchedulerLoop
    from oracle import FREE_RULE

    loop = SchedulerLoop(config, runner=runner)
    drafts, cost, trees = [], None, [0]
    if spec:
        cost = loop.spec.draft_cost  # measured at start (STANDALONE), the largest rank's
        # the batch of 6 would decode plainly by the cost model (a tiny draft's step costs about
        # the target's): verify every draft, which is what is checked here
        loop.spec.rule, loop.spec.draft_cost = FREE_RULE(), 0.0
        propose = loop.spec.proposer.propose

        def recorded(inputs):
            got = propose(inputs)
            drafts.append([(i.rid, list(d.tokens), list(d.parents)) for i, d in zip(inputs, got)])
            return got

        loop.spec.proposer.propose = recorded
        attach = loop.scheduler.attach_drafts

        def counted(batch, drafts, *args, **kwargs):
            ok = attach(batch, drafts, *args, **kwargs)
            trees[0] += ok and batch.draft_parents is not None
            return ok

        loop.scheduler.attach_drafts = counted
    for i, p in enumerate(PROMPTS):
        for j, sp in enumerate(PARAMS):
            loop.add_request(TokenizedGenerateReq(f"{i}-{j}", p, SamplingParams(**sp)))
    toks: dict[str, list[int]] = {}
    while loop.has_work():
        for o in loop.step():
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
        loop.check_integrity()
    assert loop.flush_cache() and runner.page_pool.num_free == runner.page_pool.capacity
    verified = (loop.spec.stats.verify_steps, loop.spec.stats.proposed, loop.spec.stats.accepted) if spec else None
    if spec:
        proposer = loop.spec.proposer
        if hasattr(proposer, "pool"):  # STANDALONE: every draft page back once its request ended
            proposer.check_integrity()
            assert proposer.num_requests == 0 and proposer.pool.num_used == 0
        loop.spec.close()
    return toks, verified, drafts, cost, trees[0]


def _rank_main(rank: int, addr: str, model_path: str, draft_path: str, out) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.engine.model_executor.parallel import close_tp, init_tp

    torch.set_num_threads(1)
    try:
        init_tp(rank, 2, addr, 60.0, torch.device("cpu"))
        runner = ModelRunner(EngineConfig(**BASE, model_path=model_path))
        results = {name: run_loop(EngineConfig(**BASE, model_path=model_path, **spec), runner, bool(spec))
                   for name, spec in variants(draft_path).items()}
        out.put((rank, results, None))
        close_tp()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, None, f"{type(e).__name__}: {e}"))
        raise


def test_tp2_ranks_verify_alike_and_greedy_equals_tp1_plain(tmp_path):
    from pdserve.engine.config import EngineConfig
    from pdserve.entrypoints.cluster import free_port
    from pdserve.engine.model_executor.model_runner import ModelRunner

    model, draft = str(tmp_path / "llama"), str(tmp_path / "draft")
    make_tiny_checkpoint("llama", model)
    make_tiny_checkpoint("qwen2", draft)  # other weights, the same tokenizer: most guesses wrong
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, addr, model, draft, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        torch.set_num_threads(1)
        plain_tp1 = EngineConfig(**BASE, model_path=model)
        tp1, _, _, _, _ = run_loop(plain_tp1, ModelRunner(plain_tp1), False)  # while the ranks load
        got = {}
        deadline = time.monotonic() + 240
        while len(got) < 2:
            try:
                rank, results, error = out.get(timeout=1.0)
            except queue.Empty:
                assert time.monotonic() < deadline and all(p.exitcode in (None, 0) for p in procs), "a rank died"
                continue
            assert error is None, f"rank {rank}: {error}"
            got[rank] = results
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    # both ranks: the same tokens, verify counts, drafts (every one, in order) and price of a draft token
    assert got[0] == got[1]
    plain = got[0]["plain"][0]
    for i in range(len(PROMPTS)):  # TP 2 plain decoding is TP 1's, greedy
        assert plain[f"{i}-0"] == tp1[f"{i}-0"]
    stats = {}
    for name in ("NGRAM", "W8A16", "DRAFT"):
        spec, (verified, proposed, accepted), drafts, cost, trees = got[0][name]
        assert verified > 0 and any(toks for step in drafts for _, toks, _ in step), name
        stats[name] = (proposed, accepted)
        for i in range(len(PROMPTS)):
            assert spec[f"{i}-0"] == tp1[f"{i}-0"], (name, i)  # greedy
            assert all(len(spec[f"{i}-{j}"]) == 14 for j in range(len(PARAMS)))
        assert (cost > 0) == (name != "NGRAM"), (name, cost)
        if name == "NGRAM":  # tree verify steps too: each rank moved its own KV shard alike
            assert trees > 0
    # the w8a16 self-draft guesses the greedy requests' tokens (a guess is greedy: sampled requests
    # reject most), the other checkpoint's weights guess worse
    assert stats["NGRAM"][1] > 0 and stats["W8A16"][1] > stats["DRAFT"][1], stats
