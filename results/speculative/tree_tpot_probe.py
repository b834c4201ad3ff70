"""Time per output token at batch 1, default model (bf16, 1 thread), NGRAM chains (1 branch) vs
trees (2 branches), both engines alive, runs taking turns, on bench_spec's copy and chat prompts
(greedy, 96 tokens). Process CPU time per token as well as wall TPOT: the machine is shared, and
CPU time does not count the time other jobs hold the cores.

    .venv/bin/python results/speculative/tree_tpot_probe.py
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

from bench_spec import workloads  # noqa: E402

from pdserve.engine import Engine  # noqa: E402
from pdserve.engine.text.tokenizer import load_tokenizer  # noqa: E402
rows = workloads(load_tokenizer(None), 96)
PROMPTS = {"copy": [list(r.prompt_ids) for r in rows["copy"][:3]], "chat": [list(r.prompt_ids) for r in rows["chat"][:3]]}


def tpot(engine, ids):
    times = []
    c0 = time.process_time()
    for chunk in engine.generate(input_ids=ids, sampling_params={"temperature": 0.0, "max_new_tokens": 96, "ignore_eos": True},
                                 stream=True):
        times.append((time.perf_counter(), len(chunk["output_ids"]), chunk["meta_info"]))
    (t0, n0, _), (t1, n1, meta) = times[0], times[-1]
    return (t1 - t0) / (n1 - n0), meta, (time.process_time() - c0) / n1


print("loadavg before", os.getloadavg(), flush=True)
kw = dict(rank_on_thread=True, max_total_tokens=8192, num_threads=1, speculative_algorithm="NGRAM")
chain = Engine(**kw, speculative_ngram_branches=1)
tree = Engine(**kw, speculative_ngram_branches=2)
try:
    for name, prompts in PROMPTS.items():
        t = {"chain": [], "tree": []}
        cpu = {"chain": [], "tree": []}
        acc = {"chain": [], "tree": []}
        for rep in range(3):
            for ids in prompts:
                for side, e in (("chain", chain), ("tree", tree)) if rep % 2 == 0 else (("tree", tree), ("chain", chain)):
                    s, meta, c = tpot(e, ids)
                    t[side].append(s)
                    cpu[side].append(c)
                    acc[side].append(meta.get("spec_accept_length", 1.0))
                # bf16: a tree's per-segment attention calls and a chain's one call round differently, so the
                # greedy streams may part after a few dozen tokens (in fp32 they are identical)
        m = {k: statistics.median(v) for k, v in t.items()}
        mc = {k: statistics.median(v) for k, v in cpu.items()}
        a = {k: statistics.mean(v) for k, v in acc.items()}
        print(f"{name}: TPOT chain {m['chain']*1e3:.1f} ms, tree {m['tree']*1e3:.1f} ms, ratio {m['tree']/m['chain']:.3f}; "
              f"CPU per token chain {mc['chain']*1e3:.1f} ms, tree {mc['tree']*1e3:.1f} ms, ratio {mc['tree']/mc['chain']:.3f}; "
              f"tokens per verify chain {a['chain']:.2f}, tree {a['tree']:.2f}", flush=True)
finally:
    chain.shutdown()
    tree.shutdown()
print("loadavg after", os.getloadavg())
