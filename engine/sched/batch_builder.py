"""Turn a ScheduledBatch (requests and lengths) into the model's ForwardBatch (tensors)."""

from __future__ import annotations

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.sched.scheduler import ScheduledBatch
from pdserve.engine.speculative.proposer import is_chain, tree_depths


def input_logprob_rows(batch: ScheduledBatch) -> list[tuple[int, int, int]]:
    """Extra logits rows for prompt logprobs: (request index, packed row, prompt position scored).

    The logits at position ``q`` score the prompt token at ``q + 1``. Rows come
    after the sampled rows in ``logits_indices``.
    """
    rows = []
    offset = 0
    for i, (req, start, n) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
        if req.wants_input_logprobs:
            first = max(req.logprob_start_len + len(req.input_logprobs), 1, start + 1)
            for p in range(first, min(start + n, req.prompt_len - 1) + 1):
                rows.append((i, offset + p - 1 - start, p))
        offset += n
    return rows


def build_forward_batch(batch: ScheduledBatch, page_size: int, device: str | torch.device = "cpu") -> ForwardBatch:
    if batch.draft_parents is not None:
        return build_tree_forward_batch(batch, page_size, device)
    if batch.drafts is not None:
        return build_chain_verify_batch(batch, page_size, device)
    input_ids: list[int] = []
    positions: list[int] = []
    out_loc: list[int] = []
    logits_indices: list[int] = []
    seq_lens: list[int] = []
    num_pages = []
    offset = 0
    for i, (req, start, n, sample) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample)):
        end = start + n
        input_ids.extend(req.fill_slice(start, end))
        pos = range(start, end)
        positions.extend(pos)
        pages = req.pages
        out_loc.extend(pages[p // page_size] * page_size + p % page_size for p in pos)
        offset += n
        if sample:
            logits_indices.extend(range(offset - batch.logit_rows(i), offset))
        seq_lens.append(end)
        num_pages.append(-(-end // page_size))
    logits_indices.extend(row for _, row, _ in input_logprob_rows(batch))
    return _forward_batch(device, input_ids, positions, out_loc, _page_table(batch, num_pages), logits_indices,
                          list(batch.extend_lens), seq_lens, lora_slots=_lora_slots(batch, device))


def _lora_slots(batch: ScheduledBatch, device) -> torch.Tensor | None:
    """[num_tokens] int64: each row's LoRA slot (-1: base); None when no request has an adapter."""
    if all(req.lora_slot < 0 for req in batch.reqs):
        return None
    slots = torch.tensor([req.lora_slot for req in batch.reqs], dtype=torch.int64)
    return slots.repeat_interleave(torch.tensor(batch.extend_lens, dtype=torch.int64)).to(device)


def build_chain_verify_batch(batch: ScheduledBatch, page_size: int,
                             device: str | torch.device = "cpu") -> ForwardBatch:
    """A verify step of chain drafts as a decode step of expanded rows (docs/SPECULATIVE.md).

    Sequence ``i`` feeds its last token, then its draft chain: ``1 + k`` tokens at positions
    ``kv_len .. kv_len + k``. Each layer stores the step's new K/V into the pool before attention
    reads it, so each fed token is presented as its own single-token decode row: row ``j`` has
    position ``kv_len + j``, its slot, the sequence's page-table row (repeated) and
    ``seq_len = kv_len + j + 1``, and attends exactly to the prefix and the chain before it (causal
    within the chain) on every backend. The step is then all-decode: the fused native decode path
    on CPU, a CUDA graph bucket of ``sum(1 + k)`` rows on CUDA. Every fed token's logits are
    returned, the sequences' rows in batch order (what ``SchedulerLoop._run_verify`` reads). A tree
    draft (tokens with parents) cannot be expressed by lengths alone and takes another branch.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    out_loc: list[int] = []
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    table: list[list[int]] = []
    for req, start, draft, sample in zip(batch.reqs, batch.prefix_lens, batch.drafts, batch.sample):
        tokens = req.fill_slice(start, start + 1) + list(draft)
        pages = req.pages[: -(-(start + len(tokens)) // page_size)]
        first = len(input_ids)
        for j, token in enumerate(tokens):
            p = start + j
            input_ids.append(token)
            positions.append(p)
            out_loc.append(pages[p // page_size] * page_size + p % page_size)
            seq_lens.append(p + 1)
            table.append(pages)
        if sample:
            logits_indices.extend(range(first, len(input_ids)))
    # pad with page 0, the scratch page
    width = max((len(row) for row in table), default=0)
    page_table = torch.tensor([row + [0] * (width - len(row)) for row in table], dtype=torch.int32)
    return _forward_batch(device, input_ids, positions, out_loc, page_table.view(len(table), width), logits_indices,
                          [1] * len(input_ids), seq_lens)


def build_tree_forward_batch(batch: ScheduledBatch, page_size: int, device: str | torch.device = "cpu") -> ForwardBatch:
    """A verify step whose drafts include a tree (``batch.draft_parents``): each request feeds its
    last token, then its draft nodes in order, as one extend over its cached KV. Node ``j`` is stored
    in slot ``prefix + 1 + j`` but sits at position ``prefix + depth(j)``; ``tree_parents`` lets the
    attention backend mask each node to its ancestors (the KV of the accepted path is moved to its
    positions' slots afterwards: ``Scheduler._take_accepted``). Every fed row's logits are scored."""
    input_ids: list[int] = []
    positions: list[int] = []
    out_loc: list[int] = []
    seq_lens: list[int] = []
    num_pages: list[int] = []
    trees: list[list[int] | None] = []
    for i, (req, start, n) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
        draft, parents = batch.drafts[i], batch.draft_parents[i]
        end = start + n  # n == 1 + len(draft)
        input_ids.extend(req.fill_slice(start, start + 1) + draft)
        positions.append(start)
        positions.extend(start + d for d in tree_depths(parents))
        trees.append(None if is_chain(parents) else list(parents))
        out_loc.extend(req.pages[p // page_size] * page_size + p % page_size for p in range(start, end))
        seq_lens.append(end)
        num_pages.append(-(-end // page_size))
    return _forward_batch(device, input_ids, positions, out_loc, _page_table(batch, num_pages),
                          range(len(input_ids)), list(batch.extend_lens), seq_lens, tree_parents=trees)


def _page_table(batch: ScheduledBatch, num_pages: list[int]) -> torch.Tensor:
    """[bs, max pages] int32: each request's first ``num_pages[i]`` pages, padded with page 0, the
    scratch page (one tensor from one list: 6x faster than a row at a time)."""
    width = max(num_pages, default=0)
    return torch.tensor([req.pages[:n] + [0] * (width - n) for req, n in zip(batch.reqs, num_pages)],
                        dtype=torch.int32).view(len(batch.reqs), width)


def _forward_batch(device, input_ids, positions, out_loc, page_table: torch.Tensor, logits_indices,
                   extend_lens: list[int], seq_lens: list[int], **extra) -> ForwardBatch:
    """The step's lists as the model's tensors on ``device``."""
    i64 = dict(dtype=torch.int64)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, **i64).to(device),
        positions=torch.tensor(positions, **i64).to(device),
        out_cache_loc=torch.tensor(out_loc, **i64).to(device),
        page_table=page_table.to(device),
        logits_indices=torch.tensor(logits_indices, **i64).to(device),
        extend_lens=extend_lens,
        seq_lens=seq_lens,
        **extra,
    )
