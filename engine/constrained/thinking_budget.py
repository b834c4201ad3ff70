"""A reasoning budget: after so many output tokens still inside the thinking, the closing marker is forced.

It stands where a request's grammar matcher stands (``accept``, ``fill_mask``,
``terminated``, ``rejected_token``) and wraps the request's own matcher, if any,
which sees every token, forced ones included, so a grammar that holds the answer
after the thinking carries on from the forced marker. Where that grammar does not
allow the marker yet, the forcing waits until it does.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class ThinkingBudget:
    def __init__(self, inner, end_ids: Sequence[int], end_text: str, budget: int,
                 decode: Callable[[list[int]], str], start_text: str | None = None):
        """``end_ids``: the closing marker's tokens; ``end_text``: its text, looked for in what the model
        writes; ``budget``: output tokens allowed before the marker is forced; ``decode``: ids to text;
        ``start_text``: the opening marker an output that thinks begins with (None: the prompt opened the
        thinking); an output that begins otherwise does not think, and nothing is forced."""
        self._inner = inner
        self._end_ids = list(end_ids)
        self._end_text = end_text
        self._budget = budget
        self._decode = decode
        self._ids: list[int] = []
        self._forced = 0  # marker tokens forced so far
        self._done = False  # the thinking ended (by the model or by the budget), or never began
        self._start_text = start_text  # while not None: not yet known whether the output thinks

    @property
    def rejected_token(self) -> int | None:
        return self._inner.rejected_token if self._inner is not None else None

    @property
    def terminated(self) -> bool:
        return self._inner is not None and self._inner.terminated

    def _forcing(self) -> bool:
        return not self._done and self._start_text is None and len(self._ids) >= self._budget

    def accept(self, token_id: int) -> None:
        if self._inner is not None:
            self._inner.accept(token_id)
        if self._done:
            return
        if self._forcing() and token_id == self._end_ids[self._forced]:
            self._forced += 1
            self._done = self._forced == len(self._end_ids)
            return
        self._ids.append(token_id)
        if self._start_text is not None:
            head = self._decode(self._ids).lstrip()
            if head.startswith(self._start_text):
                self._start_text = None  # it thinks: the budget runs from the output's start
            elif not self._start_text.startswith(head):
                self._done = True  # it answers without thinking
                return
        tail = self._decode(self._ids[-(len(self._end_ids) + 8):])
        self._done = self._end_text in tail

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """The next marker token alone while forcing; else the inner grammar's tokens, or every token."""
        # bitmask: [rows, ceil(vocab / 32)] int32, bit t % 32 of word t // 32 allows token t
        if self._forcing():
            t = self._end_ids[self._forced]
            word, bit = t >> 5, t & 31
            if self._inner is not None and self._forced == 0:
                # the request's grammar may not allow the marker yet (its thinking too short): wait for it
                self._inner.fill_mask(bitmask, row)
                if not (int(bitmask[row, word]) >> bit) & 1:
                    return
            bitmask[row].zero_()
            bitmask[row, word] = -(1 << 31) if bit == 31 else 1 << bit
        elif self._inner is not None:
            self._inner.fill_mask(bitmask, row)
        else:
            bitmask[row].fill_(-1)
