"""TP 2: the STANDALONE w8a16 self-draft over the target's KV, its runner in the ranks' TP group and
drafting over each rank's pool shard, in two real processes joined by gloo. Both ranks draft and
accept alike (the same tokens and verify counts), greedy output equals plain decoding's, and every
rank's pages are checked after every step."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import pytest
import torch
from support.model_util import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1] + [17, 250, 3, 99] * 4, [4, 4, 8, 15, 16, 23, 42] * 2, [9, 8, 7]]


def _rank_main(rank: int, addr: str, model_path: str, out) -> None:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.messages import TokenizedGenerateReq
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.engine.model_executor.parallel import close_tp, init_tp
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sched.scheduler_loop import SchedulerLoop
    from pdserve.engine.speculative.adaptive import AdaptiveRule

    torch.set_num_threads(1)
    try:
        init_tp(rank, 2, addr, 60.0, torch.device("cpu"))
        base = dict(model_path=model_path, dtype="float32", max_total_tokens=1024, page_size=4, num_threads=1)
        runner = ModelRunner(EngineConfig(**base))
        results = {}
        for spec in (None, "STANDALONE"):
            extra = dict(speculative_draft_quantization="w8a16") if spec else {}
            loop = SchedulerLoop(EngineConfig(**base, speculative_algorithm=spec, **extra), runner=runner)
            if spec is not None:  # priced free: the tiny draft's step is all Python overhead
                assert loop.spec.shares_kv and loop.spec.proposer.runner.page_pool is runner.page_pool
                loop.spec.draft_cost = 0.0
                loop.spec.rule = AdaptiveRule(loop.spec.rule.max_draft_tokens)
            for i, p in enumerate(PROMPTS):
                loop.add_request(TokenizedGenerateReq(f"r{i}", p, SamplingParams(max_new_tokens=14, temperature=0.0,
                                                                                 ignore_eos=True)))
            toks: dict[str, list[int]] = {}
            while loop.has_work():
                for o in loop.step():
                    toks.setdefault(o.rid, []).extend(o.new_token_ids)
                loop.check_integrity()
            stats = loop.spec.stats if loop.spec is not None else None
            results[spec] = (toks, (stats.verify_steps, stats.accepted) if stats else None)
            assert loop.flush_cache()
            if loop.spec is not None:
                loop.spec.close()
        out.put((rank, results, None))
        close_tp()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, None, f"{type(e).__name__}: {e}"))
        raise


def test_tp2_self_draft_over_each_ranks_shard_drafts_alike_and_greedy_equals_plain(tmp_path):
    from pdserve.entrypoints.cluster import free_port

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
    assert got[0] == got[1]  # the same tokens, verify steps and accepts on both ranks
    plain, _ = got[0][None]
    spec, (verified, accepted) = got[0]["STANDALONE"]
    assert verified > 0 and accepted > 0
    assert spec == plain
