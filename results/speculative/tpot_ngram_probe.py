"""TPOT at batch 1, default model (bf16), speculation off vs NGRAM, both engines alive, runs taking turns."""
import os, statistics, time
from pdserve.engine import Engine
PASSAGE = open("engine/speculative/ngram.py").read()[:1500]
PROMPTS = {"copy": f"Here is a Python file:\n\n{PASSAGE}\n\nRepeat the file above exactly, from its first line:\n\n",
           "chat": "Write a short story about a cat who learns to play the piano."}
def tpot(engine, prompt):
    times = []
    for chunk in engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": 96, "ignore_eos": True}, stream=True):
        times.append((time.perf_counter(), len(chunk["output_ids"]), chunk["meta_info"]))
    (t0, n0, _), (t1, n1, meta) = times[0], times[-1]
    return (t1 - t0) / (n1 - n0), meta
print("loadavg before", os.getloadavg())
with Engine(rank_on_thread=True, max_total_tokens=8192, num_threads=2) as off, \
     Engine(rank_on_thread=True, max_total_tokens=8192, num_threads=2, speculative_algorithm="NGRAM") as ngram:
    for name, prompt in PROMPTS.items():
        t = {"off": [], "NGRAM": []}
        for _ in range(5):
            for side, e in (("off", off), ("NGRAM", ngram)):
                s, meta = tpot(e, prompt)
                t[side].append(s)
        m = {k: statistics.median(v) for k, v in t.items()}
        spec = {k: round(v, 2) for k, v in meta.items() if k.startswith("spec")}
        print(f"{name}: TPOT off {m['off']*1e3:.1f} ms, NGRAM {m['NGRAM']*1e3:.1f} ms, ratio {m['NGRAM']/m['off']:.2f}; {spec}", flush=True)
print("loadavg after", os.getloadavg())
