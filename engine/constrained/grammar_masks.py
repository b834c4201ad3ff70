"""A scheduler rank's structured-output step: masks filled off the critical path.

The matchers of a batch's requests are current before its forward starts (each
accepted its previous token when that was sampled), so the allowed-token bitmask
for this step is filled on a worker thread while the forward runs; xgrammar
releases the GIL while it fills. After the forward, ``PendingMask.apply`` waits
for it (usually long done: a fill takes microseconds per request, a forward
milliseconds) and masks the logits before sampling.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from pdserve.engine.constrained.grammar_backend import GrammarBackend, RequestGrammar


class PendingMask:
    """One step's bitmask being filled; ``apply`` masks the logits once it is ready."""

    def __init__(self, backend: GrammarBackend, bitmask: torch.Tensor, rows: list[int], fill: Future):
        self._backend = backend
        self._bitmask = bitmask
        self._rows = rows
        self._fill = fill

    def apply(self, logits: torch.Tensor, rows: list[int] | None = None) -> None:
        """Forbidden tokens of the constrained rows (or of ``rows`` among them) get -inf, in place.
        logits: [batch, vocab]."""
        self._fill.result()
        self._backend.apply_bitmask(logits, self._bitmask, self._rows if rows is None else rows)

    def forbidden_rows(self, token_ids: torch.Tensor) -> list[int]:
        """The constrained rows whose grammar forbids their ``token_ids[row]``. token_ids: [batch] int64."""
        self._fill.result()
        rows = torch.tensor(self._rows, dtype=torch.int64)
        ids = token_ids.cpu()[rows]
        words = self._bitmask[rows, ids >> 5]  # bit t % 32 of word t // 32 is token t
        allowed = (words >> (ids & 31).to(words.dtype)) & 1
        return rows[allowed == 0].tolist()


class GrammarMasks:
    """Compiles each request's grammar (the backend built on first use) and fills batch masks."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._backend: GrammarBackend | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._bitmask: torch.Tensor | None = None

    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = GrammarBackend(*self._args)
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._backend

    def matcher(self, grammar: tuple[str, str]) -> RequestGrammar:
        """A matcher for ``(kind, text)``; ValueError when it does not compile."""
        return self.backend().matcher(*grammar)

    def begin(self, grammars: Sequence[RequestGrammar | None]) -> PendingMask | None:
        """Start filling the bitmask of a batch whose row i is constrained by ``grammars[i]``
        (None: unconstrained). None when no row is constrained."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        backend = self.backend()
        if self._bitmask is None or self._bitmask.shape[0] < len(grammars):
            self._bitmask = backend.allocate_bitmask(max(len(grammars), 2 * len(rows)))
        bitmask = self._bitmask
        fill = self._worker.submit(_fill, [(i, grammars[i]) for i in rows], bitmask)
        return PendingMask(backend, bitmask, rows, fill)


def _fill(rows: list[tuple[int, RequestGrammar]], bitmask: torch.Tensor) -> None:
    for i, grammar in rows:
        grammar.fill_mask(bitmask, i)
