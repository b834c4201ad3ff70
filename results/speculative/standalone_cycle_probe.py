"""STANDALONE w8a16 self-draft at batch 1, in process: decode TPOT off vs STANDALONE over one target
runner (bf16, default model), runs taking turns, and where a speculating step's time goes (proposer,
verify forward, the rest). Chat prompts (bench_spec's questions), greedy, 64 tokens.

    .venv/bin/python results/speculative/standalone_cycle_probe.py [threads] [draft tokens] [repeats]
"""
import dataclasses
import os
import statistics
import sys
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.messages import TokenizedGenerateReq
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.scheduler_loop import SchedulerLoop

QUESTIONS = ["Explain how a refrigerator keeps food cold.", "Write a short story about a lost dog finding its way home.",
             "What are the main causes of the seasons on Earth?", "Describe how to bake a loaf of bread."]
THREADS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
K = int(sys.argv[2]) if len(sys.argv) > 2 else 2
REPEATS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
NEW = 64


def run(loop, prompt, rid):
    """Decode seconds per token after the first (the prefill step excluded), and the forward time."""
    loop.add_request(TokenizedGenerateReq(rid, prompt, SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                                      ignore_eos=True), stream=True))
    n, t_first, fwd = 0, None, [0.0]
    forward = loop.runner.forward

    def timed_forward(*a, **kw):
        t0 = time.perf_counter()
        out = forward(*a, **kw)
        fwd[0] += time.perf_counter() - t0
        return out

    loop.runner.forward = timed_forward
    try:
        while loop.has_work():
            outs = loop.step()
            for o in outs:
                n += len(o.new_token_ids)
            if t_first is None and n:
                t_first, fwd[0] = time.perf_counter(), 0.0
                n0 = n
    finally:
        loop.runner.forward = forward
    loop.flush_cache()
    return (time.perf_counter() - t_first) / (n - n0), fwd[0]


def main():
    print("loadavg before", os.getloadavg(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), flush=True)
    base = EngineConfig(dtype="bfloat16", max_total_tokens=8192, num_threads=THREADS)
    runner = ModelRunner(base)
    tok = runner.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids for q in QUESTIONS]
    off = SchedulerLoop(base, runner=runner)
    spec = SchedulerLoop(dataclasses.replace(base, speculative_algorithm="STANDALONE", speculative_num_draft_tokens=K,
                                             speculative_draft_quantization="w8a16"), runner=runner)
    print(f"threads {THREADS}, draft tokens {K}; draft step cost {spec.spec.draft_cost:.3f} of the target's", flush=True)
    t_off, t_spec, props, fwds = [], [], [], []
    for rep in range(REPEATS):
        for i, p in enumerate(prompts):
            s0 = dataclasses.replace(spec.spec.stats)
            a, _ = run(off, p, f"o{rep}{i}")
            b, fwd = run(spec, p, f"s{rep}{i}")
            st = spec.spec.stats
            t_off.append(a)
            t_spec.append(b)
            props.append((st.proposer_s - s0.proposer_s) / (NEW - 1))
            fwds.append(fwd / (NEW - 1))
    st = spec.spec.stats
    mo, ms = statistics.median(t_off), statistics.median(t_spec)
    print(f"TPOT off {mo*1e3:.2f} ms, STANDALONE {ms*1e3:.2f} ms, ratio {ms/mo:.3f} (median of {len(t_off)} runs)")
    print(f"per output token in STANDALONE: proposer {statistics.median(props)*1e3:.2f} ms, target forwards "
          f"{statistics.median(fwds)*1e3:.2f} ms (verify and plain), the rest "
          f"{(ms - statistics.median(props) - statistics.median(fwds))*1e3:.2f} ms")
    print(f"accepted {st.accepted} of {st.proposed} ({st.accepted / max(st.proposed, 1):.2f}), {st.verify_steps} "
          f"verify steps, {st.backoff_steps} backed off")
    print("loadavg after", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
