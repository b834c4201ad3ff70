"""The contract between the scheduler side and the model: one step's inputs.

Tokens of all sequences in the step are packed into one ragged batch; sequence
``i`` owns ``input_ids[cu[i]:cu[i+1]]`` where ``cu`` is the prefix sum of
``extend_lens``. Before attention each layer writes the new tokens' K/V into
their slots (``out_cache_loc``), so attention reads prefix and new tokens
alike from the page pool through ``page_table``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute position in its sequence
    out_cache_loc: torch.Tensor  # [num_tokens] int64, slot = page * page_size + offset
    page_table: torch.Tensor  # [bs, max_pages] int32, pages of each sequence, padded with 0
    logits_indices: torch.Tensor  # [num_sampled] int64, packed rows whose logits are wanted
    extend_lens: list[int]  # [bs] new tokens per sequence this step (1 for decode)
    seq_lens: list[int]  # [bs] tokens in the cache after this step (prefix + new)
    # verify steps with draft trees (docs/SPECULATIVE.md, "Trees"): per sequence, its draft nodes'
    # parents (-1: the fed token, the sequence's first new row; node j is row 1 + j, at position
    # prefix + its depth). Each row attends to the prefix, the fed token and its own ancestors. None
    # (the field or a sequence's entry): the new rows are causal, one position each.
    tree_parents: list[list[int] | None] | None = None
    # [num_tokens] int64: each row's LoRA slot (-1: the base model); None: no row uses an adapter
    lora_slots: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence adds exactly one token: backends may take the paged-decode path."""
        return all(n == 1 for n in self.extend_lens)

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens)]
