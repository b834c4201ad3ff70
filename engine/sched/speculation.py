"""The decode loop's speculation: ask the proposer for drafts, then verify the scored rows.

``SchedulerLoop`` calls ``attach`` on every decode batch (the proposer's drafts, cut by the
adaptive rule, ride on the batch if their pages fit: ``Scheduler.attach_drafts``) and, after the
one forward of a batch that carries drafts, ``verify`` to turn each speculating request's rows of
logits into its accepted tokens (``speculative/verify.py``). Requests that cannot speculate decode
plainly in the same batch (one row each): those returning logprobs or using penalties (their
per-token bookkeeping stays the plain path's).

Structured output: a constrained request's rows are checked in order with its grammar matcher.
Each row is masked by the grammar state after the drafts before it; a draft the grammar forbids
has probability 0 under the masked row and is rejected, and the matcher only ever accepts the
tokens that stand, so it needs no rollback and no output breaks the grammar.
"""

from __future__ import annotations

import random
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.sched.request import Req
from pdserve.engine.sched.scheduler import ForwardMode, ScheduledBatch, Scheduler
from pdserve.engine.speculative.adaptive import AdaptiveRule
from pdserve.engine.speculative.proposer import DraftInput
from pdserve.engine.speculative.registry import create_proposer
from pdserve.engine.speculative.spec_metrics import SpecStats
from pdserve.engine.speculative.verify import accept_greedy, accept_sampled, sample_row, step_uniforms, target_probs
from pdserve.kernels.sampling import greedy_ids


def can_speculate(req: Req) -> bool:
    """Requests whose tokens come from the plain path only: logprobs and penalties are per token."""
    p = req.sampling_params
    return not req.return_logprob and p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty


class Speculation:
    def __init__(self, config: EngineConfig, runner, grammars):
        self.proposer = create_proposer(config, runner)
        # a proposer that runs a model prices each draft token (STANDALONE: a draft step, in target steps)
        self.draft_cost = getattr(self.proposer, "cost_per_token", 0.0)
        # a self-draft over the target's KV (``self_draft.py``) writes into reserved draft slots
        self.shares_kv = getattr(self.proposer, "shares_target_kv", False)
        self.rule = AdaptiveRule(config.speculative_num_draft_tokens, draft_step=self.draft_cost,
                                 draft_group=getattr(self.proposer, "group_rows", 0))
        self.stats = SpecStats()
        self.grammars = grammars
        self._bitmask = None  # one row, for the constrained requests' rows in turn

    # ----------------------------------------------------------------- drafts
    def attach(self, batch: ScheduledBatch, scheduler: Scheduler) -> bool:
        """Give decode ``batch`` its drafts if any request has one and their pages fit."""
        if batch.mode != ForwardMode.DECODE:
            return False
        budgets = []
        for r in batch.reqs:
            if not can_speculate(r):
                budgets.append(0)
                continue
            self.stats.backoff_steps += self.rule.backing_off(r.rid)  # this step is one of its pause
            budgets.append(min(self.rule.budget(r.rid), max(r.remaining_new_tokens - 1, 0)))
        rids = [r.rid for r in batch.reqs]
        if self.draft_cost:  # drafts that cost a model's steps: the rule cuts the budgets, before they are paid
            budgets = [len(d) for d in self.rule.cut_batch(rids, [[0] * b for b in budgets])]
        asked = [i for i, b in enumerate(budgets) if b > 0]
        if not asked:
            return False
        held = None
        if self.shares_kv:  # the draft writes its K/V into the draft slots: their pages come first
            held = scheduler.reserve_draft_pages(batch, budgets)
            if held is None:
                return False
        t0 = time.perf_counter()
        got = self.proposer.propose([self._input(batch.reqs[i], budgets[i]) for i in asked])
        self.stats.proposer_s += time.perf_counter() - t0
        drafts: list[list[int]] = [[] for _ in batch.reqs]
        for i, d in zip(asked, got):
            drafts[i] = _chain(d)[: budgets[i]]
        if not self.draft_cost:
            drafts = self.rule.cut_batch(rids, drafts)
        return scheduler.attach_drafts(batch, drafts, held)

    def _input(self, req: Req, budget: int) -> DraftInput:
        if self.shares_kv:
            return DraftInput(req.rid, req.fill_ids, budget, pages=req.pages, kv_len=req.kv_len)
        return DraftInput(req.rid, req.fill_ids, budget)

    # ----------------------------------------------------------------- verify
    def verify(self, reqs: list[Req], drafts: list[list[int]], logits: list[torch.Tensor],
               rng: random.Random) -> list[list[int]]:
        """Per speculating request (``drafts[i]`` non-empty; ``logits[i]`` its [len + 1, vocab] rows,
        float32): the tokens it gains. Counts each verify."""
        out: list[list[int]] = []
        greedy = [i for i, r in enumerate(reqs) if r.grammar is None and r.sampling_params.is_greedy]
        argmax = {}
        if greedy:  # one argmax over every greedy row of the batch
            ids = greedy_ids(torch.cat([logits[i] for i in greedy])).tolist()
            k = 0
            for i in greedy:
                argmax[i] = ids[k : k + len(drafts[i]) + 1]
                k += len(drafts[i]) + 1
        for i, (req, draft, rows) in enumerate(zip(reqs, drafts, logits)):
            if i in argmax:
                tokens = accept_greedy(argmax[i], draft)
            elif req.grammar is not None:
                tokens = self._verify_constrained(req, draft, rows, rng)
            else:
                tokens = self._accept_sampled(req, draft, rows, rng)
            out.append(tokens)
            accepted = len(tokens) - 1
            self.stats.verified(len(draft), accepted)
            self.rule.verified(req.rid, len(draft), accepted)
            req.spec_verify_ct += 1
            req.spec_proposed_tokens += len(draft)
            req.spec_accepted_tokens += accepted
        return out

    def _accept_sampled(self, req: Req, draft: list[int], rows: torch.Tensor, rng: random.Random) -> list[int]:
        p = req.sampling_params
        probs = target_probs(rows, p.temperature, p.top_k, p.top_p, p.min_p)
        return accept_sampled(probs, draft, step_uniforms(p.seed, len(req.output_ids), len(draft) + 1, rng))

    def _verify_constrained(self, req: Req, draft: list[int], rows: torch.Tensor, rng: random.Random) -> list[int]:
        """Row by row under the grammar; the matcher accepts each token that stands (and stops the
        run where the grammar completes)."""
        backend = self.grammars.backend()
        if self._bitmask is None:
            self._bitmask = backend.allocate_bitmask(1)
        p = req.sampling_params
        uniforms = None if p.is_greedy else step_uniforms(p.seed, len(req.output_ids), len(draft) + 1, rng)
        out: list[int] = []
        grammar = req.grammar
        for i in range(len(draft) + 1):
            row = rows[i : i + 1].clone()
            grammar.fill_mask(self._bitmask, 0)
            backend.apply_bitmask(row, self._bitmask, [0])
            x = draft[i] if i < len(draft) else None
            if p.is_greedy:
                t = int(greedy_ids(row)[0])
            else:
                t = sample_row(target_probs(row, p.temperature, p.top_k, p.top_p, p.min_p)[0], x, uniforms[i])
            out.append(t)
            grammar.accept(t)
            if t != x or grammar.terminated or grammar.rejected_token is not None:
                break
        return out

    # --------------------------------------------------------------- lifetime
    def release(self, req: Req) -> None:
        self.proposer.release(req.rid)
        self.rule.release(req.rid)

    def close(self) -> None:
        self.proposer.close()


def _chain(draft) -> list[int]:
    """The draft's first chain (from the fed token, each node's first child): this verify step scores chains."""
    out: list[int] = []
    node = -1
    for j, parent in enumerate(draft.parents):
        if parent == node:
            out.append(draft.tokens[j])
            node = j
    return out
