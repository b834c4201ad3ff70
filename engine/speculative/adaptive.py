"""When speculation pays: per request and per batch, from accept lengths and a cost model (pure logic).

Cost model (docs/SPECULATIVE.md, "When it speculates"): a decode step of ``bs`` sequences that
carries drafts feeds ``R = bs + sum(k_i)`` rows and costs about

    c(bs, R) = 1 + fixed(bs) + beta(bs) * (R - bs) / bs

plain steps of the same batch: ``fixed`` is what a verify step costs beyond a plain one, ``beta``
one more draft row per sequence (the verify is a decode step of expanded rows; measured on this
CPU: ``fixed(1) = 0.08, beta(1) = 0.05``, ``fixed(8) = 0.03, beta(8) = 0.39``, linear between, ``fixed``
0.04 and 0 of it the forward, the rest the loop's verify bookkeeping). A
draft model's ``k`` decode steps (``draft_step`` each, in target steps of one sequence) run for
all drafting requests at once, ``draft_group`` rows a forward, and are added over a plain step of
the batch (``1 + plain_growth * (bs - 1)`` such steps). The step yields ``bs + A`` tokens where
``A`` is the drafts accepted, so it pays while ``A > bs * (c - 1)``.

- Per request: its accept length ``a`` is an exponential moving average over its verify steps
  (starting from a prior of 1 accepted draft, so a single miss does not end a probe). The next
  draft is at most ``ceil(ema) + 1`` tokens (a draft far past what is usually accepted only
  costs). When ``ema <= fixed(1) + beta(1) * k`` after a verify (speculating does not pay even
  alone) the request backs off: it decodes plainly for ``backoff`` steps, then probes again with
  a fresh average; each failed probe doubles the backoff (up to ``max_backoff``), a verify that
  pays on its own resets it.
- Per batch: the drafts are kept for the ``m`` requests of the best averages, for the ``m`` that
  maximizes the expected tokens per cost, ``(bs + A_m) / c(bs, R_m)`` with ``A_m = sum(min(ema_i,
  k_i))``; when no ``m > 0`` beats plain decoding (``bs / 1``), the batch decodes plainly, except
  once every ``explore_every`` (32) such steps, when the drafts of the requests not measured since
  their last probe are verified (cut to ``ceil(prior) + 1`` tokens: enough to measure, cheaper to
  verify), so that a batch whose prior says "does not pay" still learns the real averages (copy-heavy requests then speculate at batch 8 too), unless even every draft
  accepted would not pay (a draft model whose steps cost too much at that batch size). Requests
  that do not pay back off with growing pauses, so exploring costs little where nothing is accepted.

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
    # the cost model's constants at batch 1 and batch 8 (see the module docstring)
    fixed: tuple[float, float] = (0.08, 0.03)
    beta: tuple[float, float] = (0.05, 0.39)
    min_backoff: int = 8
    max_backoff: int = 128
    smoothing: float = 0.5  # weight of the newest verify in the average
    # the average a probe starts from: one miss alone does not end it; at batch 8 it lets a
    # never-measured request verify a 1-token draft, not a 3-token one (1.41 of the batch's tokens)
    prior: float = 1.0
    # a batch where no draft pays by the prior still verifies its unmeasured requests' drafts once
    # in this many decode steps, so that their real average is learned (a copy pays at batch 8 too)
    explore_every: int = 32
    # a draft model's decode step (STANDALONE), in target decode steps of one sequence; 0: drafts
    # cost nothing (NGRAM). Its k steps run for every drafting request at once, ``draft_group``
    # rows a forward (0: all in one), so drafting costs k * ceil(m / group) such steps, whatever bs
    draft_step: float = 0.0
    draft_group: int = 0
    # a plain decode step of bs sequences costs 1 + plain_growth * (bs - 1) steps of one (measured)
    plain_growth: float = 0.09
    _steps: int = 0
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

    def cost(self, bs: int, rows: int, draft_steps: int = 0, drafting: int = 0) -> float:
        """``c(bs, R)``: a step of ``bs`` sequences feeding ``rows`` rows, in plain steps of that batch,
        plus, for a draft model, its ``draft_steps`` decode steps over ``drafting`` requests."""
        if rows <= bs:
            return 1.0
        t = (bs - 1) / 7  # 0 at batch 1, 1 at batch 8, extrapolated past it
        fixed = self.fixed[0] + t * (self.fixed[1] - self.fixed[0])
        beta = self.beta[0] + t * (self.beta[1] - self.beta[0])
        c = 1.0 + fixed + beta * (rows - bs) / bs
        if self.draft_step and draft_steps:
            forwards = draft_steps * (-(-drafting // self.draft_group) if self.draft_group else 1)
            c += self.draft_step * forwards / (1.0 + self.plain_growth * (bs - 1))
        return c

    def cut_batch(self, rids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """The drafts worth a verify step: those of the ``m`` best averages, for the ``m`` (0: none)
        that maximizes the expected tokens per unit of cost, ``(bs + A_m) / c(bs, R_m)``."""
        bs = len(drafts)
        order = sorted((i for i in range(bs) if drafts[i]), key=lambda i: -self._expected(rids[i]))
        kept = set(order[: self._best_m(rids, drafts, order)])
        self._steps += 1
        if not kept and self._steps % self.explore_every == 0:
            # exploring measures: drafts as long as the prior's expected run (and one more) suffice,
            # and a shorter verify is a cheaper one where the batch's guesses mostly miss
            n = math.ceil(self.prior) + 1
            unmeasured = [i for i in order if self._unmeasured(rids[i])]
            if self._pays_at_best(bs, [min(len(drafts[i]), n) for i in unmeasured]):
                return [d[:n] if i in unmeasured else [] for i, d in enumerate(drafts)]
        return [d if i in kept else [] for i, d in enumerate(drafts)]

    def _best_m(self, rids: list[str], drafts: list[list[int]], order: list[int]) -> int:
        """How many of the drafts, taken in ``order`` (best averages first), maximize the expected
        tokens per cost; 0 where none beats plain decoding."""
        bs = len(drafts)
        best_m, best_rate = 0, 1.0  # no drafts: bs tokens for one plain step
        gain, rows, longest = 0.0, bs, 0
        for m, i in enumerate(order, 1):
            gain += min(self._expected(rids[i]), len(drafts[i]))
            rows += len(drafts[i])
            longest = max(longest, len(drafts[i]))
            rate = (bs + gain) / (bs * self.cost(bs, rows, longest, m))
            if rate > best_rate:
                best_m, best_rate = m, rate
        return best_m

    def worth_asking(self, rids: list[str], budgets: list[int]) -> bool:
        """Before a proposer that costs nothing (NGRAM) is asked: whether ``cut_batch`` could keep any
        draft this step. Each request's draft is taken at the lengths it pays best at (``floor`` and
        ``ceil`` of its expected run, within its budget: a row past them gains at most what it costs);
        an exploring step that is due asks too. False counts the step as ``cut_batch`` does: the
        proposer is not asked, the batch decodes plainly (NGRAM's lookups cost nothing then)."""
        for rounding in (math.floor, math.ceil):
            drafts = [[0] * min(b, max(1, rounding(self._expected(r)))) if b > 0 else []
                      for r, b in zip(rids, budgets)]
            order = sorted((i for i in range(len(drafts)) if drafts[i]), key=lambda i: -self._expected(rids[i]))
            if self._best_m(rids, drafts, order):
                return True
        if (self._steps + 1) % self.explore_every == 0 and any(
                b > 0 and self._unmeasured(r) for r, b in zip(rids, budgets)):
            return True
        self._steps += 1
        return False

    def _pays_at_best(self, bs: int, lens: list[int]) -> bool:
        """Whether drafts of ``lens`` tokens in a batch of ``bs`` would pay if every one were accepted:
        where not (a costly draft model, a large batch), exploring could only cost."""
        n = sum(lens)
        return n > 0 and (bs + n) / (bs * self.cost(bs, bs + n, max(lens), len(lens))) > 1.0

    def _unmeasured(self, rid: str) -> bool:
        st = self._reqs.get(rid)
        return st is None or st.ema is None

    def _expected(self, rid: str) -> float:
        st = self._reqs.get(rid)
        return self.prior if st is None or st.ema is None else st.ema

    def verified(self, rid: str, proposed: int, accepted: int) -> None:
        """Record a verify step of ``rid`` that checked ``proposed`` drafts and accepted ``accepted``."""
        if proposed <= 0:
            return
        st = self._reqs.setdefault(rid, _ReqState())
        prior = self.prior if st.ema is None else st.ema
        st.ema = (1 - self.smoothing) * prior + self.smoothing * accepted
        threshold = self.cost(1, 1 + proposed, proposed, 1) - 1  # what speculating alone must gain to pay
        if st.ema > threshold:
            if accepted > threshold:  # this verify paid on its own: past pauses are forgotten
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
