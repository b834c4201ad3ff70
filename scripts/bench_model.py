"""ModelRunner vs Hugging Face transformers on the same dequantized weights, same dtype, same process.

Measures prefill tokens/s on 512-token prompts and decode tokens/s at batch 1 and 64,
alternating pdserve and transformers runs so that load from other jobs on the
machine hits both alike; reports the best of ``--repeats`` for each, by wall clock
and by process CPU time (the steadier figure when other jobs share the cores;
with one thread it is the compute time). Ends with one JSON line.

    .venv/bin/python scripts/bench_model.py [--dtype bfloat16] [--threads 2] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_loader import load_model, save_hf_checkpoint
from pdserve.engine.model_executor.model_runner import ModelRunner


def prefill_batch(prompts: torch.Tensor, page_table: torch.Tensor, slots: torch.Tensor) -> ForwardBatch:
    """One step prefilling every prompt of ``prompts`` [bs, plen] (no prefix) into its pages:
    ``page_table`` [bs, P] int32, ``slots`` [bs, >= plen] the slots of each sequence in order."""
    bs, plen = prompts.shape
    return ForwardBatch(
        input_ids=prompts.reshape(-1), positions=torch.arange(plen).repeat(bs),
        out_cache_loc=slots[:, :plen].reshape(-1), page_table=page_table,
        logits_indices=torch.arange(bs) * plen + plen - 1, extend_lens=[plen] * bs, seq_lens=[plen] * bs,
    )


def ours_generate(runner: ModelRunner, prompts: torch.Tensor, new_tokens: int) -> tuple[float, ...]:
    """Greedy: one prefill step for all prompts, then ``new_tokens - 1`` decode steps.
    Returns wall seconds of (prefill, decode), then CPU seconds of (prefill, decode)."""
    pool = runner.page_pool
    ps = pool.page_size
    bs, plen = prompts.shape
    total = plen + new_tokens
    pages = [pool.alloc(pool.pages_for(total)) for _ in range(bs)]
    try:
        page_table = torch.tensor(pages, dtype=torch.int32)
        slots = (page_table.long()[:, :, None] * ps + torch.arange(ps)).reshape(bs, -1)  # [bs, total slots]
        t0, c0 = time.perf_counter(), time.process_time()
        nxt = runner.forward(prefill_batch(prompts, page_table, slots)).argmax(-1)
        t1, c1 = time.perf_counter(), time.process_time()
        for step in range(new_tokens - 1):
            pos = plen + step
            batch = ForwardBatch(
                input_ids=nxt, positions=torch.full((bs,), pos), out_cache_loc=slots[:, pos].contiguous(),
                page_table=page_table, logits_indices=torch.arange(bs), extend_lens=[1] * bs,
                seq_lens=[pos + 1] * bs,
            )
            nxt = runner.forward(batch).argmax(-1)
        t2, c2 = time.perf_counter(), time.process_time()
        return t1 - t0, t2 - t1, c1 - c0, c2 - c1
    finally:
        for p in pages:
            pool.free(p)


@torch.inference_mode()
def hf_generate(model, prompts: torch.Tensor, new_tokens: int) -> tuple[float, ...]:
    """transformers greedy generate, timed by a stopping criterion that notes the clocks after
    every generated token. Returns wall (prefill, decode) then CPU (prefill, decode) seconds."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []
            self.cpu: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            self.cpu.append(time.process_time())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    clock = Clock()
    t0, c0 = time.perf_counter(), time.process_time()
    model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                   do_sample=False, eos_token_id=None, pad_token_id=0,
                   stopping_criteria=StoppingCriteriaList([clock]))
    return (clock.times[0] - t0, clock.times[-1] - clock.times[0],
            clock.cpu[0] - c0, clock.cpu[-1] - clock.cpu[0])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--decode-prompt-len", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--only", default="prefill,decode1,decode64")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    runner = ModelRunner(EngineConfig(dtype=args.dtype, max_total_tokens=80 * 1024, num_threads=args.threads))
    arch, weights, _ = load_model(None)
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(arch, weights, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
    del weights

    results = {}
    n = args.new_tokens
    vocab = arch.vocab_size

    for name in args.only.split(","):
        if name == "prefill":
            prompts = torch.randint(100, vocab, (args.prefill_batch, args.prefill_len))
            ours_generate(runner, prompts[:1, :64], 2)  # warm up
            hf_generate(hf, prompts[:1, :64], 2)
            figures = {}
            for _ in range(args.repeats):  # alternate, one run each per round
                for who, fn in (("ours", lambda: ours_generate(runner, prompts, 1)),
                                ("hf", lambda: hf_generate(hf, prompts, 1))):
                    wall, _, cpu, _ = fn()
                    old = figures.get(who, (float("inf"), float("inf")))
                    figures[who] = (min(old[0], wall), min(old[1], cpu))
            key, tokens = "prefill", prompts.numel()
        else:
            bs = int(name.removeprefix("decode"))
            prompts = torch.randint(100, vocab, (bs, args.decode_prompt_len))
            ours_generate(runner, prompts, 3)
            hf_generate(hf, prompts, 3)
            figures = {}
            for _ in range(args.repeats):
                for who, fn in (("ours", lambda: ours_generate(runner, prompts, n)),
                                ("hf", lambda: hf_generate(hf, prompts, n))):
                    _, wall, _, cpu = fn()
                    old = figures.get(who, (float("inf"), float("inf")))
                    figures[who] = (min(old[0], wall), min(old[1], cpu))
            key, tokens = f"decode{bs}", bs * (n - 1)
        results[f"{key}_tok_s"] = tokens / figures["ours"][0]
        results[f"hf_{key}_tok_s"] = tokens / figures["hf"][0]
        results[f"{key}_cpu_tok_s"] = tokens / figures["ours"][1]
        results[f"hf_{key}_cpu_tok_s"] = tokens / figures["hf"][1]
        print({k: round(v, 1) for k, v in results.items()}, flush=True)
    for key in [k for k in results if not k.startswith("hf_")]:
        results[key.replace("_tok_s", "_ratio")] = results[key] / results["hf_" + key]
    results.update(dtype=args.dtype, threads=args.threads, new_tokens=n)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in results.items()}))


if __name__ == "__main__":
    main()
