"""NGRAM trees offline: accepted drafts per verify over real greedy outputs, by branches and budget.

Greedy outputs of the default model (bf16, 128 tokens, EOS ignored) on bench_spec's copy and chat
prompts are generated once (cached in /tmp); then at every output position the proposer drafts
with ``k`` nodes and the tree is walked along the real next tokens (greedy acceptance: exactly what
a verify step would accept). Prints accepted drafts per verify (over positions that had a draft)
and per position (every step), for branches 1..4 and node weights (merge_tree's rank and depth
weights: "default" is ngram.py's 0.6 / 0.7).

    .venv/bin/python scripts/bench_ngram_trees.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_spec, beside this script

from pdserve.engine.speculative.ngram import NgramProposer, merge_tree  # noqa: E402
from pdserve.engine.speculative.proposer import DraftInput  # noqa: E402
from pdserve.engine.speculative.verify import accept_greedy_tree  # noqa: E402

CACHE = "/tmp/spectree_outputs.json"
OUT_LEN = 128


def outputs() -> dict[str, list[list[int]]]:
    if os.path.exists(CACHE):
        return json.load(open(CACHE))
    from bench_spec import workloads
    from pdserve.engine import Engine
    from pdserve.engine.text.tokenizer import load_tokenizer

    rows = workloads(load_tokenizer(None), OUT_LEN)
    got = {}
    with Engine(rank_on_thread=True, max_total_tokens=8192, num_threads=2) as e:
        for name, rs in rows.items():
            res = e.generate(input_ids=[list(r.prompt_ids) for r in rs],
                             sampling_params={"temperature": 0.0, "max_new_tokens": OUT_LEN, "ignore_eos": True})
            got[name] = [list(row.prompt_ids) + r["output_ids"] for row, r in zip(rs, res)]
            got[name + "_prompt_lens"] = [r.prompt_len for r in rs]
    json.dump(got, open(CACHE, "w"))
    return got


def simulate(seqs, prompt_lens, k: int, branches: int, **weights) -> tuple[float, float, float]:
    verifies = accepted = steps = nodes = 0
    for s, (seq, plen) in enumerate(zip(seqs, prompt_lens)):
        p = NgramProposer(1, 12, branches)
        pos = plen + 1  # the first output token comes from the prefill
        while pos < len(seq):
            (d,) = p.propose([DraftInput(f"r{s}", seq[:pos], k)])
            if weights and d.tokens:
                d = merge_tree(p._indexes[f"r{s}"].candidates(k, branches), k, **weights)
            steps += 1
            if d.tokens:
                # the target's argmax after a node on the real path is the real next token
                depth = []
                for par in d.parents:
                    depth.append(1 if par < 0 else depth[par] + 1)
                target = [seq[pos]] + [seq[pos + dj] if pos + dj < len(seq) else -1 for dj in depth]
                _, path = accept_greedy_tree(target, d.tokens, d.parents)
                a = min(len(path), len(seq) - pos - 1)
                verifies += 1
                accepted += a
                nodes += len(d.tokens)
                pos += a + 1
            else:
                pos += 1
    return accepted / max(verifies, 1), accepted / max(steps, 1), nodes / max(verifies, 1)


def main():
    got = outputs()
    print(f"load average {os.getloadavg()}")
    print("| workload | k | branches | weights | accepted / verify | accepted / step | nodes / verify |")
    print("|---|---|---|---|---|---|---|")
    for name in ("copy", "chat"):
        for k in (2, 3, 4, 8):
            for b in (1, 2, 3, 4):
                for w in ({}, {"rank_weight": 0.3, "depth_weight": 0.8}, {"rank_weight": 0.9, "depth_weight": 0.5}):
                    if b == 1 and w:
                        continue
                    av, ast, nv = simulate(got[name], got[name + "_prompt_lens"], k, b, **w)
                    ws = "default" if not w else f"{w['rank_weight']}/{w['depth_weight']}"
                    print(f"| {name} | {k} | {b} | {ws} | {av:.2f} | {ast:.2f} | {nv:.1f} |", flush=True)


if __name__ == "__main__":
    main()
