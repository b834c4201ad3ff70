"""When speculation pays: per request and per batch, from accept lengths and a cost model (pure logic).

Cost model (docs/SPECULATIVE.md, "When it speculates"): a verify step that feeds a sequence its
last token plus ``k`` drafts costs about ``c(k) = 1 + beta * k`` plain decode steps (``beta``: the
cost of one more query row relative to a whole step, measured on the machine). It yields
``1 + a`` tokens where ``a`` is the number of drafts accepted. So speculation pays while the
expected accept length exceeds ``beta * k``.

- Per request: ``a`` is tracked as an exponential moving average over the request's verify steps
  (starting from a prior of 1 accepted draft, so a single miss does not end a probe).
  The next draft is at most ``ceil(ema) + 1`` tokens (a draft far past what is usually accepted only
  costs). When ``ema <= beta * k`` after a verify the request backs off: it decodes plainly for
  ``backoff`` steps, then probes again with a fresh average; each failed probe doubles the backoff
  (up to ``max_backoff``), a verify that pays on its own resets it.
- Per batch: a step of ``n`` query rows stays near the cost of one row only while the weights'
  read dominates; past ``max_verify_tokens`` rows the drafts of the requests with the lowest
  averages are cut first. A batch that cannot keep a draft runs plainly.

The state is a function of the tokens alone (no clocks), so every TP rank decides alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _ReqState:
    ema: float | None = None  # accepted drafts per verify step; None: no verify since the last probe
    skip: int = 0  # plain steps left before the next probe
    backoff: int = 0  # the skip of the next back-off


@dataclass
class AdaptiveRule:
    max_draft_tokens: int
    beta: float = 0.1  # cost of one more query row, as a fraction of a plain decode step
    max_verify_tokens: int = 64  # query rows of a verify step (drafts + fed tokens) before drafts are cut
    min_backoff: int = 8
    max_backoff: int = 128
    smoothing: float = 0.5  # weight of the newest verify in the average
    prior: float = 1.0  # the average a probe starts from: one miss alone does not end it
    _reqs: dict[str, _ReqState] = field(default_factory=dict)

    def budget(self, rid: str) -> int:
        """How many drafts ``rid`` may propose this step (0: it decodes plainly); counts a skipped step."""
        st = self._reqs.setdefault(rid, _ReqState())
        if st.skip > 0:
            st.skip -= 1
            return 0
        if st.ema is None:
            return self.max_draft_tokens
        return min(self.max_draft_tokens, math.ceil(st.ema) + 1)

    def cut_batch(self, rids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """Drafts cut so that the step feeds at most ``max_verify_tokens`` rows; best averages keep theirs."""
        rows = len(drafts) + sum(map(len, drafts))
        if rows <= self.max_verify_tokens:
            return drafts
        out = [list(d) for d in drafts]
        order = sorted(range(len(out)), key=lambda i: self._ema(rids[i]))
        for i in order:  # lowest average first
            cut = min(len(out[i]), rows - self.max_verify_tokens)
            if cut:
                del out[i][len(out[i]) - cut :]
                rows -= cut
            if rows <= self.max_verify_tokens:
                break
        return out

    def _ema(self, rid: str) -> float:
        st = self._reqs.get(rid)
        return -1.0 if st is None or st.ema is None else st.ema

    def verified(self, rid: str, proposed: int, accepted: int) -> None:
        """Record a verify step of ``rid`` that checked ``proposed`` drafts and accepted ``accepted``."""
        if proposed <= 0:
            return
        st = self._reqs.setdefault(rid, _ReqState())
        prior = self.prior if st.ema is None else st.ema
        st.ema = (1 - self.smoothing) * prior + self.smoothing * accepted
        if st.ema > self.beta * proposed:
            if accepted > self.beta * proposed:  # this verify paid on its own: past pauses are forgotten
                st.backoff = 0
            return
        st.backoff = min(max(2 * st.backoff, self.min_backoff), self.max_backoff)
        st.skip = st.backoff
        st.ema = None

    def backing_off(self, rid: str) -> bool:
        st = self._reqs.get(rid)
        return st is not None and st.skip > 0

    def release(self, rid: str) -> None:
        self._reqs.pop(rid, None)
