"""Grammar compilation against the model's vocabulary, and one matcher per request.

A scheduler rank builds one ``GrammarBackend`` on its first constrained request
(importing xgrammar and indexing the vocabulary cost ~2 s, which ranks that
never see a grammar skip). Compiled grammars are cached by xgrammar, so many
requests with one schema compile it once; the cache holds at most
``GRAMMAR_CACHE_BYTES`` (xgrammar evicts the least recently used).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pdserve.engine.constrained.grammar_spec import xgrammar_message

GRAMMAR_CACHE_BYTES = 64 * 2**20


class RequestGrammar:
    """The grammar state of one request: advanced with each token it outputs."""

    def __init__(self, matcher):
        self._matcher = matcher
        self.rejected_token: int | None = None  # a token the grammar refused (a bug: masks forbid it)

    def accept(self, token_id: int) -> None:
        if self.rejected_token is None and not self._matcher.is_terminated():
            if not self._matcher.accept_token(token_id):
                self.rejected_token = token_id

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the request ends."""
        return self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (one bit per vocabulary entry)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        """``vocab_size``: the model's logits width (may exceed the tokenizer's); ``stop_token_ids``:
        the tokens that end a request (the model's EOS), allowed once the grammar is complete."""
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        # one compile thread: the rank's model threads own the other cores
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES)

    def matcher(self, kind: str, text: str) -> RequestGrammar:
        """A fresh matcher for a grammar of ``kind`` (see ``grammar_spec.GRAMMAR_FIELDS``);
        raises ValueError when the grammar does not compile."""
        try:
            if kind == "json_schema":
                # compact JSON (no free whitespace): a small model left free to put whitespace
                # between tokens may keep emitting it until max_new_tokens, never closing the object
                compiled = self._compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            else:
                compiled = self._compiler.compile_grammar(text)
        except RuntimeError as exc:
            raise ValueError(f"{kind} is invalid: {xgrammar_message(exc)}") from None
        return RequestGrammar(self._xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 bitmask of ``rows`` rows: [rows, ceil(vocab / 32)]."""
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the logits of forbidden tokens to -inf, in place, in the given rows."""
        # logits: [batch, vocab] float32; bitmask: [>= batch, vocab / 32] int32
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                              indices=rows)
