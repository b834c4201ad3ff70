"""A scheduler rank's structured-output step: grammars compiled and masks filled off the critical path.

``compile`` builds a request's matcher on a compile thread (the backend too, on first use), so
that a large grammar never stalls the rank's other requests; the scheduler loop admits the request
when the future is done, or refuses it at its deadline.

The matchers of a batch's requests are current before its forward starts (each
accepted its previous token when that was sampled), so the allowed-token bitmask
for this step is filled on a worker thread while the forward runs; xgrammar
releases the GIL while it fills. After the forward, ``PendingMask.apply`` waits
for it (usually long done: a fill takes microseconds per request, a forward
milliseconds) and masks the logits before sampling.
"""

from __future__ import annotations

import threading
import time
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


class CompileJob:
    """One grammar being compiled: ``started`` is set (monotonic seconds) when its compilation
    begins, after those queued before it and the backend's one-time build."""

    def __init__(self):
        self.future: Future | None = None
        self.started: float | None = None

    def overdue(self, now: float, timeout: float) -> bool:
        return self.started is not None and now - self.started >= timeout and not self.future.done()


class GrammarMasks:
    """Compiles each request's grammar (the backend built on first use) and fills batch masks."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._backend: GrammarBackend | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()  # the backend is built once, by whichever thread needs it first
        self._bitmask: torch.Tensor | None = None

    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                self._backend = GrammarBackend(*self._args)
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            return self._backend

    def compile(self, grammar: tuple[str, str]) -> "CompileJob":
        """The matcher for ``(kind, text)``, built on the compile thread (``CompileJob.future``
        raises ValueError when the grammar does not compile)."""
        job = CompileJob()

        def run() -> RequestGrammar:
            backend = self.backend()  # built once, before this grammar's clock starts
            job.started = time.monotonic()
            return backend.matcher(*grammar)

        job.future = self._compiler.submit(run)
        return job

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
