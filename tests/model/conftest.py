"""A greedy loop over ModelRunner that allocates pages itself, as the scheduler would."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.forward_batch import ForwardBatch


def greedy_generate(runner, prompts: list[list[int]], max_new: int, forced: list[list[int]] | None = None):
    """Prefill all prompts in one ragged batch, then decode them together.

    Returns (tokens, logits): tokens[i] are sequence i's argmax picks, logits[i] its
    [max_new, vocab] logits. With ``forced``, sequence i is fed forced[i][t] at step t
    instead of its own pick (teacher forcing), so its logits follow another model's path.
    """
    pool = runner.page_pool
    ps = pool.page_size
    bs = len(prompts)
    pages = [pool.alloc(pool.pages_for(len(p) + max_new)) for p in prompts]
    width = max(len(p) for p in pages)
    page_table = torch.zeros(bs, width, dtype=torch.int32)
    for i, p in enumerate(pages):
        page_table[i, : len(p)] = torch.tensor(p)

    def slot(i: int, pos: int) -> int:
        return pages[i][pos // ps] * ps + pos % ps

    tokens = [[] for _ in range(bs)]
    logits = [[] for _ in range(bs)]
    try:
        lens = [len(p) for p in prompts]
        ends = torch.tensor(lens).cumsum(0) - 1
        batch = ForwardBatch(
            input_ids=torch.tensor([t for p in prompts for t in p]),
            positions=torch.cat([torch.arange(n) for n in lens]),
            out_cache_loc=torch.tensor([slot(i, j) for i, n in enumerate(lens) for j in range(n)]),
            page_table=page_table,
            logits_indices=ends,
            extend_lens=list(lens),
            seq_lens=list(lens),
        )
        for step in range(max_new):
            out = runner.forward(batch)
            assert out.shape == (bs, runner.arch.vocab_size) and out.dtype == torch.float32
            feed = []
            for i in range(bs):
                tokens[i].append(int(out[i].argmax()))
                logits[i].append(out[i])
                feed.append(forced[i][step] if forced else tokens[i][-1])
            positions = [n + step for n in lens]
            batch = ForwardBatch(
                input_ids=torch.tensor(feed),
                positions=torch.tensor(positions),
                out_cache_loc=torch.tensor([slot(i, p) for i, p in enumerate(positions)]),
                page_table=page_table,
                logits_indices=torch.arange(bs),
                extend_lens=[1] * bs,
                seq_lens=[p + 1 for p in positions],
            )
    finally:
        for p in pages:
            pool.free(p)
        pool.check_integrity()
    return tokens, [torch.stack(x) for x in logits]


def hf_greedy(model, prompt: list[int], max_new: int):
    """transformers greedy generate, never stopping early: (tokens, [max_new, vocab] logits)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True,
    )
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


@pytest.fixture
def greedy():
    return greedy_generate
