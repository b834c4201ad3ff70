"""One benchmark side in a process of its own, driven by ``bench_engine.py`` over its stdin and
stdout: a pdserve Engine, or Hugging Face transformers' ``generate`` (``{"hf": ...}``).

Each side of a benchmark gets its own process, so each has one OpenMP pool: Engines sharing a
process each bring one, and libgomp then throttles its barrier spin for all of them (every
side's steps ran slower, most at 2 threads). The Engine imported is whatever ``pdserve`` the
process finds first, so with ``PYTHONPATH`` at another revision's tree
(``benchlib.revision_tree``) the same messages measure that revision.

Messages are JSON lines. In: ``{"engine": {Engine kwargs}}`` (or ``{"hf": {"path", "dtype",
"threads"}}``: an HF checkpoint through ``transformers``) once, then ``{"generate":
{"input_ids": [[...]], "sampling_params": {...}}}`` any number of times; out: ``{"ready": true}``
and then ``{"output_ids": [[...]]}`` per generate, or ``{"error": "..."}``. End of input shuts
the Engine down.
"""

from __future__ import annotations

import json
import os
import sys


class HFGenerate:
    """transformers' greedy ``generate`` over prompts of one length (no padding), as an Engine's
    ``generate`` answers: a list of ``{"output_ids"}``."""

    def __init__(self, path: str, dtype: str, threads: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def generate(self, input_ids, sampling_params):
        torch = self.torch
        n = sampling_params["max_new_tokens"]
        with torch.inference_mode():
            ids = torch.tensor(input_ids, dtype=torch.int64)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, pad_token_id=0)
        return [{"output_ids": row} for row in out[:, ids.shape[1]:].tolist()]

    def shutdown(self):
        pass


def main() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the Engine prints goes to stderr; stdout carries the replies
    engine = None
    try:
        for line in sys.stdin:
            msg = json.loads(line)
            try:
                if "engine" in msg:
                    from pdserve.engine import Engine

                    engine = Engine(**msg["engine"])
                    reply = {"ready": True}
                elif "hf" in msg:
                    engine = HFGenerate(**msg["hf"])
                    reply = {"ready": True}
                else:
                    res = engine.generate(**msg["generate"])
                    reply = {"output_ids": [r["output_ids"] for r in res]}
            except Exception as e:  # noqa: BLE001 - the benchmark shows it and stops
                reply = {"error": f"{type(e).__name__}: {e}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        if engine is not None:
            engine.shutdown()


if __name__ == "__main__":
    main()
