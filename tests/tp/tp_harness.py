"""Run a model at tensor parallel ``tp`` in ``tp`` real processes joined by gloo, greedy, without a server.

Each rank builds the real ModelRunner (its shard, its KV pool of its heads) and runs
``greedy_generate``; the caller gets rank 0's tokens and logits and every rank's pool shape
(and, with ``record_experts``, what each rank's expert recorder counted and its dump).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time

import torch

from pdserve.entrypoints.cluster import free_port

RANK_TIMEOUT_S = 60.0  # collective timeout of the harness's group
MAX_TOTAL_TOKENS = 2048


def _expert_record(runner, run) -> dict:
    """Record the experts over ``run()``: this rank's own counts, the group's dump (an all-reduce
    every rank joins) and this rank's MoE metric families by sample name."""
    runner.expert_recorder.start()
    result = run()
    own = runner.expert_recorder.counts.tolist()
    every = runner.model_families()
    families = {s.name: s.value for f in every for s in f.samples if not s.labels}
    runner.expert_recorder.stop()
    layers = runner.expert_recorder.layers
    eplb = None if runner.eplb is None else [runner.eplb.rebalances, runner.eplb.moved]
    return {"result": result, "own": own, "dump": runner.expert_recorder.dump().tolist(), "metrics": families,
            "placement": {i: list(layer.placement.physical_to_logical) for i, layer in layers.items()}, "eplb": eplb,
            "families": every}


def _rank_main(rank: int, tp: int, addr: str, model_path: str | None, prompts, max_new: int, out,
               engine_kw: dict, record_experts: bool = False) -> None:
    from support.model_util import greedy_generate

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_executor.model_runner import ModelRunner
    from pdserve.engine.model_executor.parallel import close_tp, init_tp

    torch.set_num_threads(1)
    try:
        init_tp(rank, tp, addr, RANK_TIMEOUT_S, torch.device("cpu"))
        runner = ModelRunner(EngineConfig(model_path=model_path, dtype="float32", max_total_tokens=MAX_TOTAL_TOKENS,
                                          num_threads=1, **engine_kw))
        experts = None
        if record_experts:
            experts = _expert_record(runner, lambda: greedy_generate(runner, prompts, max_new))
            tokens, logits = experts.pop("result")
        else:
            tokens, logits = greedy_generate(runner, prompts, max_new)
        entry = (tuple(runner.page_pool.k[0].shape), runner.tp) + ((experts,) if record_experts else ())
        out.put((rank, tokens, [x.numpy() for x in logits] if rank == 0 else None, entry))
        close_tp()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, None, None, f"{type(e).__name__}: {e}"))
        raise


def run_tp(model_path: str | None, tp: int, prompts: list[list[int]], max_new: int, timeout: float = 300.0,
           record_experts: bool = False, **engine_kw):
    """``(tokens, logits, {rank: (pool k shape, HeadShard)})`` of a greedy run at TP ``tp``;
    ``engine_kw``: more ``EngineConfig`` fields (e.g. ``ep_size``). ``record_experts``: the run is
    recorded (``expert_recorder``) and each rank's entry gains a third item, ``{"own": its counts,
    "dump": the group's, "metrics": its MoE counters by sample name, "placement": each MoE layer's
    physical -> logical map at the end, "eplb": [rebalances, expert copies moved] or None,
    "families": its MoE metric families as ``RankMetrics`` carries them}``."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, tp, addr, model_path, prompts, max_new, out, engine_kw, record_experts), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    try:
        results = {}
        deadline = time.monotonic() + timeout
        while len(results) < tp:
            try:
                rank, tokens, logits, entry = out.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"TP ranks {dead} died" if dead else f"no result within {timeout} s") from None
                continue
            if tokens is None:
                raise RuntimeError(f"TP rank {rank} failed: {entry}")
            results[rank] = (tokens, logits, entry)
        for p in procs:
            p.join(30)
        return results[0][0], results[0][1], {r: v[2] for r, v in results.items()}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
