"""Batch 8, default model (bf16): wall time of 8 requests x 128 greedy tokens, speculation off vs NGRAM,
both engines alive, runs taking turns (3 each, medians). Prefill is the same on both sides."""
import os, statistics, time
from pdserve.engine import Engine
PASSAGE = open("engine/speculative/ngram.py").read()[:1500]
PROMPTS = {"copy": [f"File {i}:\n\n{PASSAGE}\n\nRepeat the file above exactly, from its first line:\n\n" for i in range(8)],
           "chat": [f"Write a short story about a cat named {n}." for n in "ABCDEFGH"]}
print("loadavg before", os.getloadavg())
with Engine(rank_on_thread=True, max_total_tokens=16384, num_threads=2) as off, \
     Engine(rank_on_thread=True, max_total_tokens=16384, num_threads=2, speculative_algorithm="NGRAM") as ngram:
    for name, prompts in PROMPTS.items():
        t = {"off": [], "NGRAM": []}
        for _ in range(3):
            for side, e in (("off", off), ("NGRAM", ngram)):
                t0 = time.perf_counter()
                out = e.generate(prompts, {"temperature": 0.0, "max_new_tokens": 128, "ignore_eos": True})
                t[side].append(time.perf_counter() - t0)
        m = {k: statistics.median(v) for k, v in t.items()}
        verify = sum(o["meta_info"]["spec_verify_ct"] for o in out)
        print(f"{name}: batch 8 wall off {m['off']:.2f} s, NGRAM {m['NGRAM']:.2f} s, ratio {m['NGRAM']/m['off']:.2f}; "
              f"verify steps {verify} over 8 x 128 tokens", flush=True)
print("loadavg after", os.getloadavg())
