"""Decode CPU time per output token, speculation off vs NGRAM vs STANDALONE (w8a16 self-draft, 2 draft
tokens), in process over one target runner (default model, bf16, 1 thread): bench_spec's workloads
(copy, chat) at batch 1 and 8, greedy, 64 tokens. Process CPU time, not wall: on this shared machine
wall time moves 2x between adjacent runs, a single thread's CPU time much less. Runs take turns;
medians over the repeats.

    .venv/bin/python results/speculative/spec_cpu_probe.py [repeats]
"""
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))

from bench_spec import COPY_ASKS, PASSAGES, QUESTIONS  # noqa: E402

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.messages import TokenizedGenerateReq  # noqa: E402
from pdserve.engine.model_executor.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.sched.scheduler_loop import SchedulerLoop  # noqa: E402

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
NEW = 64


def decode_cpu_per_token(loop, prompts, tag):
    """CPU seconds per output token from the step after the last prefill to the end."""
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        loop.add_request(TokenizedGenerateReq(f"{tag}{i}", p, params, stream=True))
    got, t0, n0 = 0, None, 0
    while loop.has_work():
        for o in loop.step():
            got += len(o.new_token_ids)
        if t0 is None and got >= len(prompts):  # every request has its first token: decoding from here
            t0, n0 = time.process_time(), got
    loop.flush_cache()
    return (time.process_time() - t0) / max(got - n0, 1)


def main():
    print("loadavg before", os.getloadavg(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), flush=True)
    base = EngineConfig(dtype="bfloat16", max_total_tokens=16384, num_threads=1)
    runner = ModelRunner(base)
    tok = runner.tokenizer

    def chat(text):
        return tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False).input_ids

    work = {"copy": [chat(COPY_ASKS[i % 2] + PASSAGES[i % 4]) for i in range(8)],
            "chat": [chat(QUESTIONS[i % 8]) for i in range(8)]}
    loops = {"off": SchedulerLoop(base, runner=runner),
             "NGRAM": SchedulerLoop(dataclasses.replace(base, speculative_algorithm="NGRAM"), runner=runner),
             "STANDALONE": SchedulerLoop(dataclasses.replace(base, speculative_algorithm="STANDALONE",
                                                             speculative_num_draft_tokens=2,
                                                             speculative_draft_quantization="w8a16"), runner=runner)}
    print(f"STANDALONE draft step {loops['STANDALONE'].spec.draft_cost:.3f} of the target's", flush=True)
    for name, prompts in work.items():
        for bs in (1, 8):
            t = {k: [] for k in loops}
            for rep in range(REPEATS):
                for k, loop in loops.items():
                    if bs == 1:  # one request at a time, two of them
                        t[k].append(statistics.mean(decode_cpu_per_token(loop, [p], f"{k}{rep}{j}")
                                                    for j, p in enumerate(prompts[rep % 4 :: 4][:2])))
                    else:
                        t[k].append(decode_cpu_per_token(loop, prompts, f"{k}{rep}b"))
            m = {k: statistics.median(v) for k, v in t.items()}
            print(f"{name} batch {bs}: off {m['off']*1e3:.2f} ms/token; NGRAM {m['NGRAM']/m['off']:.3f}x; "
                  f"STANDALONE {m['STANDALONE']/m['off']:.3f}x", flush=True)
    for k in ("NGRAM", "STANDALONE"):
        st = loops[k].spec.stats
        print(f"{k}: {st.accepted} of {st.proposed} accepted, {st.verify_steps} verify steps, "
              f"{st.backoff_steps} backed off, {st.proposer_s:.1f} s in the proposer")
    print("loadavg after", os.getloadavg(), flush=True)


if __name__ == "__main__":
    main()
