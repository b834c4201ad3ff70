"""DP attention with expert parallelism against TP alone on an MoE model, through the offline
Engine: decode throughput at one batch size, and the KV pool each rank needs for it.

The model is a tiny random Qwen3-MoE written by this script with transformers (3 layers, hidden
64, 4 heads of 32, 2 KV heads, 8 experts of 48 rows, top 3: ``tests/support/model_util.py``'s
``qwen3_moe``), in the engine's default dtype (bf16 on a CPU) unless ``--dtype``. Configurations,
each on two scheduler processes (the defaults give each its own core and one thread):

- ``tp2``: ``--tp-size 2``: one scheduler, every layer split over both ranks, each rank holding
  its half of the KV heads for every request;
- ``dpattn_ep2``: ``--tp-size 2 --dp-size 2 --enable-dp-attention --ep-size 2``: two attention
  groups of one rank, each with its own scheduler and KV pool for the requests routed to it; the
  MoE layers' experts placed whole, 4 on each rank.

Batches of ``--batch`` prompts of ``--prompt-len`` random tokens, ``--new-tokens`` each (decode
dominates), greedy, ignoring EOS, each submitted at once. Each round starts each configuration in
fresh processes, runs a warm-up batch, then times ``--repeats`` batches of other prompts (the same
for both configurations; none is served from the prefix cache); rounds alternate the order of the
configurations. Output tokens/s = a batch's output tokens / its wall seconds: the median batch of
an engine, then the median over rounds. KV per rank: the tokens one batch holds at its end on the
busiest rank (the prompt and output tokens of the requests its DP rank ran, from each output's
``dp_rank``; a TP rank holds every request of its group), and their bytes in one rank's pool (the
pool's bytes per token, ``/get_server_info``); and the share of the first batch's sequences that
``dpattn_ep2`` decodes exactly as ``tp2`` (1.0 in float32; bf16 rounds the two orders of
summation apart). Ends with one JSON summary line.

Figures: docs/PERFORMANCE.md, "Data-parallel attention on one machine".

    .venv/bin/python scripts/bench_dp_attention_moe.py [--batch 64] [--new-tokens 128] [--rounds 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from pdserve.entrypoints.engine import Engine

CONFIGS = {
    "tp2": {"tp_size": 2},
    "dpattn_ep2": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2},
}
VOCAB = 512


def write_checkpoint(path: str) -> None:
    """The tiny random Qwen3-MoE (the tests' ``qwen3_moe``) and a word-level tokenizer at ``path``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                            rope_theta=1000000.0, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                            norm_topk_prob=True, tie_word_embeddings=False, initializer_range=0.1,
                            eos_token_id=2, bos_token_id=1)
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2").save_pretrained(path)


def run(model: str, flags: dict, warm: list[list[int]], batches: list[list[list[int]]], new_tokens: int,
        max_total_tokens: int, dtype: str) -> dict:
    """One configuration in fresh processes: a warm-up batch, then each of ``batches`` timed (other
    prompts each, so none is served from the prefix cache); the median batch's rate."""
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    walls, outs = [], []
    with Engine(model_path=model, dtype=dtype, max_total_tokens=max_total_tokens, **flags) as engine:
        engine.generate(input_ids=warm, sampling_params=sp)
        for prompts in batches:
            t0 = time.perf_counter()
            outs.append(engine.generate(input_ids=prompts, sampling_params=sp))
            walls.append(time.perf_counter() - t0)
        info = engine.get_server_info()
    ranks = info["internal_states"]
    attn_tp = flags["tp_size"] // flags.get("dp_size", 1) if flags.get("enable_dp_attention") else flags["tp_size"]
    # one process's pool: its DP rank's bytes over that rank's TP processes, per pool token
    bytes_per_token = ranks[0]["kv_pool_bytes"] / attn_tp / ranks[0]["max_total_num_tokens"]
    held = [0] * len(ranks)
    for p, o in zip(batches[0], outs[0]):
        held[o["meta_info"]["dp_rank"]] += len(p) + len(o["output_ids"])
    rates = [sum(len(o["output_ids"]) for o in out) / wall for out, wall in zip(outs, walls)]
    return {"wall_s": statistics.median(walls), "output_tok_s": statistics.median(rates), "kv_tokens_per_rank": max(held),
            "kv_bytes_per_rank": round(max(held) * bytes_per_token), "requests_per_dp_rank":
            [sum(o["meta_info"]["dp_rank"] == r for o in outs[0]) for r in range(len(ranks))],
            "outputs": [o["output_ids"] for o in outs[0]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="timed batches per engine")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-total-tokens", type=int, default=16384,
                    help="each DP rank's pool: room for the whole batch and its reserved decode tokens")
    args = ap.parse_args()
    rng = random.Random(0)

    def batch() -> list[list[int]]:
        return [[rng.randrange(3, VOCAB) for _ in range(args.prompt_len)] for _ in range(args.batch)]

    warm, batches = batch(), [batch() for _ in range(args.repeats)]
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as model:
        write_checkpoint(model)
        for r in range(args.rounds):
            for name in (CONFIGS if r % 2 == 0 else reversed(CONFIGS)):
                res = run(model, CONFIGS[name], warm, batches, args.new_tokens, args.max_total_tokens,
                          args.dtype)
                runs[name].append(res)
                print(f"round {r} {name}: {res['output_tok_s']:.1f} tok/s, {res['wall_s']:.2f} s, "
                      f"KV tokens per rank {res['kv_tokens_per_rank']}, requests per DP rank "
                      f"{res['requests_per_dp_rank']}", flush=True)
    summary: dict = {"batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "rounds": args.rounds, "repeats": args.repeats, "dtype": args.dtype}
    for name, rs in runs.items():
        summary[name] = {"output_tok_s": round(statistics.median(r["output_tok_s"] for r in rs), 1),
                         "wall_s": round(statistics.median(r["wall_s"] for r in rs), 2),
                         "kv_tokens_per_rank": rs[0]["kv_tokens_per_rank"],
                         "kv_bytes_per_rank": rs[0]["kv_bytes_per_rank"],
                         "requests_per_dp_rank": rs[0]["requests_per_dp_rank"]}
    base, dp = summary["tp2"], summary["dpattn_ep2"]
    summary["tok_s_ratio"] = round(dp["output_tok_s"] / base["output_tok_s"], 3)
    summary["kv_tokens_per_rank_ratio"] = round(dp["kv_tokens_per_rank"] / base["kv_tokens_per_rank"], 3)
    ref = runs["tp2"][0]["outputs"]
    summary["same_outputs_as_tp2"] = sum(a == b for a, b in zip(runs["dpattn_ep2"][0]["outputs"], ref)) / len(ref)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
