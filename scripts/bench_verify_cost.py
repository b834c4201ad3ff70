"""c(bs, 1 + k): a verify step of expanded decode rows over a plain decode step (default model, bf16,
1 thread, 300-token prefix), wall and process CPU time, median of 10 after 3 untimed. Also the w8a16
self-draft's decode step at batch 1 against the bf16 target's.

    .venv/bin/python scripts/bench_verify_cost.py
"""
import os
import statistics
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_runner import ModelRunner

PREFIX = 300


def rows_batch(pool, pages_list, n):
    """bs sequences feeding n tokens each, as single-token decode rows (batch_builder's verify form)."""
    ps = pool.page_size
    ids, pos, loc, table, lens = [], [], [], [], []
    for pages in pages_list:
        for j in range(n):
            p = PREFIX + j
            ids.append(5 + j); pos.append(p); loc.append(pages[p // ps] * ps + p % ps)
            table.append(pages); lens.append(p + 1)
    return ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(loc), torch.tensor(table, dtype=torch.int32),
                        torch.arange(len(ids)), [1] * len(ids), lens)


def timed(runner, fb, clock):
    for _ in range(3):
        runner.forward(fb)
    ts = []
    for _ in range(10):
        t0 = clock(); runner.forward(fb); ts.append(clock() - t0)
    return statistics.median(ts)


def main():
    print("loadavg before", os.getloadavg(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    target = ModelRunner(EngineConfig(max_total_tokens=8192, num_threads=1, dtype="bfloat16"))
    pool = target.page_pool
    for bs in (1, 8):
        pages_list = [pool.alloc(pool.pages_for(PREFIX + 17)) for _ in range(bs)]
        target.forward(ForwardBatch(torch.full((PREFIX * bs,), 7), torch.arange(PREFIX).repeat(bs),
                                    torch.tensor([pg[p // pool.page_size] * pool.page_size + p % pool.page_size
                                                  for pg in pages_list for p in range(PREFIX)]),
                                    torch.tensor(pages_list, dtype=torch.int32), torch.tensor([PREFIX - 1]),
                                    [PREFIX] * bs, [PREFIX] * bs))
        for name, clock in (("wall", time.perf_counter), ("cpu", time.process_time)):
            res = {k: timed(target, rows_batch(pool, pages_list, 1 + k), clock) for k in (0, 1, 2, 4, 8)}
            print(f"bs={bs} {name}: plain {res[0]*1e3:.1f} ms; "
                  + ", ".join(f"c({k})={res[k]/res[0]:.2f}" for k in (1, 2, 4, 8)), flush=True)
        for p in pages_list:
            pool.free(p)
    draft = ModelRunner(EngineConfig(max_total_tokens=8192, num_threads=1, dtype="bfloat16", quantization="w8a16"))
    for runner, name in ((target, "bf16"), (draft, "w8a16")):
        pool = runner.page_pool
        pages = pool.alloc(pool.pages_for(PREFIX + 17))
        for clock_name, clock in (("wall", time.perf_counter), ("cpu", time.process_time)):
            print(f"{name} decode step bs=1 {clock_name}: {timed(runner, rows_batch(pool, [pages], 1), clock)*1e3:.2f} ms")
        pool.free(pages)
    print("loadavg after", os.getloadavg())


if __name__ == "__main__":
    main()
