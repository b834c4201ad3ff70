#!/usr/bin/env python
"""NEXTN through PD: drafts accepted with the prompt's MTP KV sent, against the hidden state alone.

The real ``PrefillLoop`` and ``DecodeLoop`` in one process (``tests/support/loop_stand.PDPair``,
Mooncake TCP on loopback) over a one-layer DeepSeek-V3 whose MTP layer copies its layer (made here,
``tests/support/deepseek_util.py``), fp32, greedy, ``--requests`` random prompts of ``--input-len``
token ids to ``--output-len`` tokens, one request at a time, drafts always asked (the adaptive rule
priced free: on this model a draft step costs about a target step, and a server's rule would verify
none; the counters are the point here, not the speed). Three setups on the same prompts:

- colocated NEXTN (a ``SchedulerLoop``): the reference;
- 1P1D NEXTN, the decode's MTP starting from the prompt's MTP KV the prefill sent (``nextn_prompt.py``);
- 1P1D NEXTN, the decode's MTP starting from the handed-over hidden state alone (the prefill
  runs no MTP, the decode is handed no ``PromptKV``): how NEXTN went through PD before the KV.

Prints per setup the drafts proposed and accepted, the verify steps, how many requests have the
colocated counters exactly, and the prefill's compute (thread CPU seconds in its forwards, the MTP
included when it runs); then one JSON line. Every setup's output must equal colocated's.

    .venv/bin/python scripts/bench_nextn_accept.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the tests' stand and checkpoint builder

import torch  # noqa: E402
from support.deepseek_util import add_mtp_layer, make_deepseek_checkpoint  # noqa: E402
from support.loop_stand import PDPair  # noqa: E402
from support.model_util import random_prompts  # noqa: E402

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.messages import TokenizedGenerateReq  # noqa: E402
from pdserve.engine.model_executor.model_runner import ModelRunner  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.engine.sched.scheduler_loop import SchedulerLoop  # noqa: E402
from pdserve.engine.speculative.adaptive import AdaptiveRule  # noqa: E402
from pdserve.engine.speculative.nextn_handoff import mtp_kv_layers  # noqa: E402
from pdserve.kvtransfer.engines.transfer_engine import create_transfer_engine  # noqa: E402

PAGE = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def engine(path: str, **kw) -> dict:
    return dict(model_path=path, dtype="float32", max_total_tokens=4096, **kw)


def colocated(path: str, prompts: dict[str, list[int]], args) -> dict[str, tuple]:
    """Per request: (tokens, verify steps, drafts proposed, drafts accepted)."""
    nextn = dict(speculative_algorithm="NEXTN", speculative_num_draft_tokens=args.draft_tokens)
    loop = SchedulerLoop(EngineConfig(page_size=PAGE, **engine(path), **nextn),
                         runner=ModelRunner(EngineConfig(page_size=PAGE, **engine(path))))
    loop.spec.draft_cost = 0.0
    loop.spec.rule = AdaptiveRule(args.draft_tokens)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0)
    got = {}
    for rid, p in prompts.items():
        loop.add_request(TokenizedGenerateReq(rid, p, params, stream=True))
        tokens = []
        while loop.has_work():
            for o in loop.step():
                tokens.extend(o.new_token_ids)
                if o.finished:
                    got[rid] = (tokens, o.spec_verify_ct, o.spec_draft_token_num, o.spec_accept_token_num)
    loop.close()
    return got


def through_pd(path: str, prompts: dict[str, list[int]], args, prompt_kv: bool) -> tuple[dict[str, tuple], float]:
    """The same through a 1P1D pair; per request as ``colocated``, and the prefill's forward CPU seconds."""
    nextn = dict(speculative_algorithm="NEXTN", speculative_num_draft_tokens=args.draft_tokens)

    def runner() -> ModelRunner:
        return ModelRunner(EngineConfig(page_size=PAGE, **engine(path)), extra_kv_layers=mtp_kv_layers("NEXTN"))

    pair = PDPair(p_engine={**engine(path), **nextn}, d_engine={**engine(path), **nextn},
                  p_runner=runner(), d_runner=runner(),
                  p_transfer_engine=create_transfer_engine("mooncake", "127.0.0.1"),
                  d_transfer_engine=create_transfer_engine("mooncake", "127.0.0.1"))
    pair.decode.spec.draft_cost = 0.0
    pair.decode.spec.rule = AdaptiveRule(args.draft_tokens)
    if not prompt_kv:  # the prefill runs no MTP, and the decode's MTP starts from the hidden state alone
        pair.prefill.prompt_mtp = None
        handed = pair.decode.spec.observe_handed
        pair.decode.spec.observe_handed = lambda req, start, hidden, kv=None: handed(req, start, hidden)
    cpu = [0.0]
    run_batch = pair.prefill.run_batch

    def timed(batch):
        t0 = time.thread_time()
        out = run_batch(batch)
        cpu[0] += time.thread_time() - t0
        return out

    pair.prefill.run_batch = timed
    got = {}
    try:
        for rid, p in prompts.items():
            pair.submit(rid, p, max_new=args.output_len, stream=True)
            pair.run(pair.done(rid, sides="PD"), timeout=600)
            f = pair.final("D", rid)
            if f.finish_reason == "error":
                raise RuntimeError(f"{rid}: {f.error}")
            got[rid] = (pair.tokens(rid), f.spec_verify_ct, f.spec_draft_token_num, f.spec_accept_token_num)
        pair.settle()
    finally:
        pair.close()
    return got, cpu[0]


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    path = tempfile.mkdtemp(prefix="bench_nextn_accept_")
    make_deepseek_checkpoint("v3", path, num_hidden_layers=1, first_k_dense_replace=2)
    add_mtp_layer(path, copy_last=True)
    lens = [args.input_len] * args.requests
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts(lens, seed=args.seed))}
    want = colocated(path, prompts, args)
    setups = {"colocated NEXTN": (want, None)}
    setups["1P1D prompt KV"] = through_pd(path, prompts, args, prompt_kv=True)
    setups["1P1D hidden only"] = through_pd(path, prompts, args, prompt_kv=False)
    summary = {}
    for name, (got, cpu) in setups.items():
        if any(got[rid][0] != want[rid][0] for rid in prompts):
            raise AssertionError(f"{name}: output differs from colocated")
        verify, proposed, accepted = (sum(v[i] for v in got.values()) for i in (1, 2, 3))
        same = sum(got[rid][1:] == want[rid][1:] for rid in prompts)
        summary[name] = dict(proposed=proposed, accepted=accepted, verify_steps=verify, accepted_fraction=
                             round(accepted / max(proposed, 1), 3), as_colocated=same, prefill_cpu_s=cpu)
        print(f"{name:>18}: {accepted} of {proposed} drafts accepted ({accepted / max(proposed, 1):.2f}) in "
              f"{verify} verify steps; {same}/{len(prompts)} requests as colocated"
              + (f"; prefill forwards {cpu:.3f} CPU s" if cpu is not None else ""))
    kv, alone = summary["1P1D prompt KV"], summary["1P1D hidden only"]
    summary["prefill_cpu_ratio"] = round(kv["prefill_cpu_s"] / alone["prefill_cpu_s"], 3)
    print(f"prefill forwards with the MTP / without: {summary['prefill_cpu_ratio']:.2f}x")
    print(json.dumps({"bench": "nextn_accept", **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
