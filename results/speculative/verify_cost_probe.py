"""c(k): a verify step of 1 + k tokens over a plain decode step, on the default model (batch 1 and 8)."""
import time, statistics, torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
cfg = EngineConfig(max_total_tokens=8192, num_threads=1)
r = ModelRunner(cfg)
pool = r.page_pool; ps = pool.page_size
prefix = 300
def step(bs, n, pages_list):
    ids, pos, loc, rows = [], [], [], []
    for b in range(bs):
        pages = pages_list[b]
        for j in range(n):
            p = prefix + j
            ids.append(5 + j); pos.append(p); loc.append(pages[p // ps] * ps + p % ps)
            rows.append(len(ids) - 1)
    width = len(pages_list[0])
    fb = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(loc), torch.tensor(pages_list, dtype=torch.int32),
                      torch.tensor(rows), [n] * bs, [prefix + n] * bs)
    return r.forward(fb)
for bs in (1, 8):
    pages_list = [pool.alloc(pool.pages_for(prefix + 17)) for _ in range(bs)]
    # fill prefix KV once
    res = {}
    for k in (0, 1, 2, 4, 8):
        for _ in range(3): step(bs, 1 + k, pages_list)
        ts = []
        for _ in range(10):
            t0 = time.process_time(); step(bs, 1 + k, pages_list); ts.append(time.process_time() - t0)
        res[k] = statistics.median(ts)
    print(f"bs={bs} plain {res[0]*1e3:.1f} ms; " + ", ".join(f"c({k})={res[k]/res[0]:.2f}" for k in (1, 2, 4, 8)), flush=True)
    for p in pages_list: pool.free(p)
