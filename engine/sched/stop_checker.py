"""When a request stops: max_new_tokens, EOS, stop token ids, stop strings, a completed grammar.

Runs in the scheduler after every sampled token. Stop strings are matched on
the decoded text (kept incrementally on the request only when it has stop
strings); trimming them from the returned text is the Detokenizer's job.
"""

from __future__ import annotations

from typing import Iterable

from pdserve.engine.text.detokenizer import IncrementalDecoder
from pdserve.engine.sched.request import FinishReason, Req


class StopChecker:
    def __init__(self, eos_token_ids: Iterable[int] = (), tokenizer=None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.tokenizer = tokenizer

    def __call__(self, req: Req) -> FinishReason | None:
        sp = req.sampling_params
        n = len(req.output_ids)
        if req.grammar is not None and n > 0:
            if req.grammar.rejected_token is not None:
                return FinishReason("error", message=f"token {req.grammar.rejected_token} broke the request's grammar")
            if req.grammar.terminated:  # the grammar allowed nothing but a stop token, which it took
                return FinishReason("stop", matched=req.output_ids[-1])
        if n >= sp.min_new_tokens and n > 0:
            last = req.output_ids[-1]
            if last in sp.stop_token_ids:
                return FinishReason("stop", matched=last)
            if not sp.ignore_eos and last in self.eos_token_ids:
                return FinishReason("stop", matched=last)
            if sp.stop and self.tokenizer is not None:
                matched = self._match_stop_string(req)
                if matched is not None:
                    return FinishReason("stop", matched=matched)
        if n >= sp.max_new_tokens:
            return FinishReason("length")
        return None

    def _match_stop_string(self, req: Req) -> str | None:
        dec = req.text_state
        if dec is None:
            dec = req.text_state = IncrementalDecoder(self.tokenizer, req.sampling_params.skip_special_tokens)
        prev_len = len(dec.text)
        dec.feed(req.output_ids[len(dec.ids) :])
        for s in req.sampling_params.stop:
            if s and s in dec.text[max(prev_len - len(s) + 1, 0) :]:
                return s
        return None
