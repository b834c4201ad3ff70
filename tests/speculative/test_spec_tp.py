"""TP 2: both ranks of a tensor-parallel group run the colocated loop with NGRAM over their shard, fed
the same requests (as rank 0's broadcast feeds them in a server), in two real processes joined by
gloo. Every rank proposes the same drafts and accepts the same tokens, greedy and sampled (seeded or
not), and greedy outputs equal plain decoding's at TP 2."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch
from model_util import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)

# the third: "5 9 12" followed by three different tokens, so NGRAM drafts trees (several branches)
PROMPTS = [[1] + [17, 250, 3, 99] * 4, [4, 4, 8, 15, 16, 23, 42] * 2,
           [5, 9, 12, 200, 31, 5, 9, 12, 77, 31, 5, 9, 12, 140, 31, 5, 9, 12]]
PARAMS = [
    dict(max_new_tokens=14, temperature=0.0, ignore_eos=True),
    dict(max_new_tokens=14, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    dict(max_new_tokens=14, temperature=1.0, ignore_eos=True),  # unseeded: the rank's generator
]


def _rank_main(rank: int, addr: str, model_path: str, out) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.messages import TokenizedGenerateReq
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.engine.model_executor.parallel import close_tp, init_tp
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sched.scheduler_loop import SchedulerLoop
    from oracle import FREE_RULE

    torch.set_num_threads(1)
    try:
        init_tp(rank, 2, addr, 60.0, torch.device("cpu"))
        base = dict(model_path=model_path, dtype="float32", max_total_tokens=1024, page_size=4, num_threads=1)
        runner = ModelRunner(EngineConfig(**base))
        results = {}
        for spec in (None, "NGRAM"):
            spec_kw = dict(speculative_algorithm=spec, speculative_ngram_branches=2) if spec else {}
            loop = SchedulerLoop(EngineConfig(**base, **spec_kw), runner=runner)
            trees = [0]
            if spec is not None:  # the batch of 9 would decode plainly by the cost model: verify every draft
                loop.spec.rule = FREE_RULE()
                attach = loop.scheduler.attach_drafts

                def count_trees(batch, drafts, parents=None, attach=attach, trees=trees):
                    ok = attach(batch, drafts, parents)
                    trees[0] += ok and batch.draft_parents is not None
                    return ok

                loop.scheduler.attach_drafts = count_trees
            for i, p in enumerate(PROMPTS):
                for j, sp in enumerate(PARAMS):
                    loop.add_request(TokenizedGenerateReq(f"{i}-{j}", p, SamplingParams(**sp)))
            toks: dict[str, list[int]] = {}
            while loop.has_work():
                for o in loop.step():
                    toks.setdefault(o.rid, []).extend(o.new_token_ids)
                loop.check_integrity()
            verified = loop.spec.stats.verify_steps if loop.spec is not None else 0
            results[spec] = (toks, verified, trees[0])
            assert loop.flush_cache()
        out.put((rank, results, None))
        close_tp()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, None, f"{type(e).__name__}: {e}"))
        raise


def test_tp2_ranks_verify_alike_and_greedy_equals_plain(tmp_path):
    from pdserve.engine.entrypoints.cluster import free_port

    make_tiny_checkpoint("llama", str(tmp_path))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, addr, str(tmp_path), out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
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
    assert got[0] == got[1]  # the same tokens and the same verify counts on both ranks
    plain, _, _ = got[0][None]
    spec, verified, trees = got[0]["NGRAM"]
    assert verified > 0 and trees > 0  # tree verify steps too: each rank moved its own KV shard alike
    for i in range(len(PROMPTS)):
        assert spec[f"{i}-0"] == plain[f"{i}-0"]  # greedy
        assert all(len(spec[f"{i}-{j}"]) == 14 for j in range(len(PARAMS)))
