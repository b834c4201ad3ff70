"""The decode loop's speculation: ask the proposer for drafts, then verify the scored rows.

``SchedulerLoop`` calls ``attach`` on every decode batch (the proposer's drafts, cut by the
adaptive rule, ride on the batch if their pages fit: ``Scheduler.attach_drafts``) and, after the
one forward of a batch that carries drafts, ``verify`` to turn each speculating request's rows of
logits into its accepted tokens (``speculative/verify.py``). Requests that cannot speculate decode
plainly in the same batch (one row each): those returning logprobs or using penalties (their
per-token bookkeeping stays the plain path's).

Structured output: a constrained request's rows are checked in order with its grammar matcher
(a tree's: node by node along the path being accepted). Each row is masked by the grammar state
after the drafts before it; a draft the grammar forbids
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
from pdserve.engine.speculative.nextn_handoff import PromptKV
from pdserve.engine.speculative.proposer import DraftInput, chain_parents, is_chain, tree_children, tree_depths
from pdserve.engine.speculative.registry import create_proposer
from pdserve.engine.speculative.spec_metrics import SpecStats
from pdserve.engine.speculative.verify import (
    TreeUniforms, accept_greedy, accept_greedy_tree, accept_sampled, accept_sampled_tree, sample_row, sample_tree_row,
    step_uniforms, target_probs,
)
from pdserve.kernels.sampling import greedy_ids


# the accepted drafts a draft model's probe starts from (the self-draft accepted 0.98 of its
# guesses on bench_spec's chat prompts; NGRAM's prior is AdaptiveRule's, 1)
MODEL_DRAFT_PRIOR = 1.5


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
        # a draft model's guesses are a model's greedy picks, accepted far more often than prompt
        # lookups: a request it never measured starts from a higher prior
        prior = MODEL_DRAFT_PRIOR if self.draft_cost else AdaptiveRule.prior
        self.rule = AdaptiveRule(config.speculative_num_draft_tokens, prior=prior, draft_step=self.draft_cost,
                                 draft_group=getattr(self.proposer, "group_rows", 0))
        self.stats = SpecStats()
        self.grammars = grammars
        self._bitmask = None  # one row, for the constrained requests' rows in turn
        # draft trees need an attention backend that masks them (torch); elsewhere the first chain
        self.trees = getattr(getattr(runner, "attn_backend", None), "supports_tree_mask", False)
        # a proposer drafting from the target's hidden states (NEXTN) sees every step's valid rows
        self.wants_hidden = self.proposer.wants_hidden
        self._runner = runner

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
        elif not self.rule.worth_asking(rids, budgets):  # a free proposer: not asked where nothing could pay
            return False
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
        parents: list[list[int]] = [[] for _ in batch.reqs]
        for i, d in zip(asked, got):
            drafts[i], parents[i] = draft_nodes(d, budgets[i], self.trees)
        if not self.draft_cost:
            drafts = self.rule.cut_batch(rids, drafts)
        return scheduler.attach_drafts(batch, drafts, parents, held)

    def _input(self, req: Req, budget: int) -> DraftInput:
        if self.shares_kv:
            return DraftInput(req.rid, req.fill_ids, budget, pages=req.pages, kv_len=req.kv_len)
        return DraftInput(req.rid, req.fill_ids, budget)

    def observe(self, batch: ScheduledBatch, sampled) -> None:
        """Hand a ``wants_hidden`` proposer each speculating request's hidden states of the step
        just run (the target model's ``last_hidden``, rows in batch order): a prefill's every row,
        a decode step's one, a verify step's fed token and accepted drafts (``sampled.accepted``)."""
        hidden = self._runner.model.last_hidden
        row = 0
        for i, (req, start, n) in enumerate(zip(batch.reqs, batch.prefix_lens, batch.extend_lens)):
            valid = n
            if batch.drafts is not None:
                n = 1 + len(batch.drafts[i])
                valid = len(sampled.accepted[i]) if sampled.accepted is not None else 1
            if can_speculate(req):
                self.proposer.observe(req.rid, start, hidden[row : row + valid])
            row += n

    def observe_handed(self, req: Req, start: int, hidden: torch.Tensor, prompt_kv: PromptKV | None = None) -> None:
        """A PD decode's request: the hidden states [n, hidden] the prefill handed over, at positions
        ``start ..`` (NEXTN: the prompt's last), before its first decode step; ``prompt_kv``: where
        the MTP layer's KV of the positions before ``start`` came."""
        if not (self.wants_hidden and can_speculate(req)):
            return
        if prompt_kv is None:
            self.proposer.observe(req.rid, start, hidden)
        else:
            self.proposer.observe_prompt(req.rid, prompt_kv, hidden)

    # ----------------------------------------------------------------- verify
    def verify(self, reqs: list[Req], drafts: list[list[int]], parents: list[list[int]],
               logits: list[torch.Tensor], rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
        """Per speculating request (``drafts[i]`` non-empty, its nodes' parents ``parents[i]``: a chain
        or a tree; ``logits[i]`` its [1 + len, vocab] rows, float32, row 0 the fed token's, row
        ``1 + j`` node j's): the tokens it gains and its accepted nodes, root to leaf. Counts each
        verify."""
        out: list[list[int]] = []
        paths: list[list[int]] = []
        greedy = [i for i, r in enumerate(reqs) if r.grammar is None and r.sampling_params.is_greedy]
        argmax = {}
        if greedy:  # one argmax over every greedy row of the batch
            ids = greedy_ids(torch.cat([logits[i] for i in greedy])).tolist()
            k = 0
            for i in greedy:
                argmax[i] = ids[k : k + len(drafts[i]) + 1]
                k += len(drafts[i]) + 1
        for i, (req, draft, par, rows) in enumerate(zip(reqs, drafts, parents, logits)):
            chain = is_chain(par)
            if i in argmax:
                if chain:
                    tokens = accept_greedy(argmax[i], draft)
                    path = list(range(len(tokens) - 1))
                else:
                    tokens, path = accept_greedy_tree(argmax[i], draft, par)
            elif req.grammar is not None:
                tokens, path = self._verify_constrained(req, draft, par, rows, rng)
            elif chain:
                tokens = self._accept_sampled(req, draft, rows, rng)
                path = list(range(len(tokens) - 1))
            else:
                tokens, path = self._accept_sampled_tree(req, draft, par, rows, rng)
            out.append(tokens)
            paths.append(path)
            accepted = len(tokens) - 1
            self.stats.verified(len(draft), accepted)
            self.rule.verified(req.rid, len(draft), accepted)
            req.spec_verify_ct += 1
            req.spec_proposed_tokens += len(draft)
            req.spec_accepted_tokens += accepted
        return out, paths

    def _accept_sampled(self, req: Req, draft: list[int], rows: torch.Tensor, rng: random.Random) -> list[int]:
        p = req.sampling_params
        probs = target_probs(rows, p.temperature, p.top_k, p.top_p, p.min_p)
        return accept_sampled(probs, draft, step_uniforms(p.seed, len(req.output_ids), len(draft) + 1, rng))

    def _accept_sampled_tree(self, req: Req, draft: list[int], parents: list[int], rows: torch.Tensor,
                             rng: random.Random) -> tuple[list[int], list[int]]:
        p = req.sampling_params
        probs = target_probs(rows, p.temperature, p.top_k, p.top_p, p.min_p)
        uniforms = TreeUniforms(p.seed, len(req.output_ids), max(tree_depths(parents), default=0) + 1, rng)
        return accept_sampled_tree(probs, draft, parents, uniforms)

    def _verify_constrained(self, req: Req, draft: list[int], parents: list[int], rows: torch.Tensor,
                            rng: random.Random) -> tuple[list[int], list[int]]:
        """Node by node along the accepted path under the grammar: each node's row is masked by the
        matcher's state after the tokens that stood before it (a forbidden child has probability 0
        and is never taken); the matcher accepts each token that stands (and the run stops where the
        grammar completes). Returns the tokens and the accepted nodes."""
        backend = self.grammars.backend()
        if self._bitmask is None:
            self._bitmask = backend.allocate_bitmask(1)
        p = req.sampling_params
        chain = is_chain(parents)
        depths = max(tree_depths(parents), default=0) + 1
        uniforms = None
        if not p.is_greedy:
            uniforms = (step_uniforms(p.seed, len(req.output_ids), depths, rng) if chain
                        else TreeUniforms(p.seed, len(req.output_ids), depths, rng))
        children = tree_children(parents)
        out: list[int] = []
        path: list[int] = []
        grammar = req.grammar
        node = -1
        while True:
            row = rows[node + 1 : node + 2].clone()
            grammar.fill_mask(self._bitmask, 0)
            backend.apply_bitmask(row, self._bitmask, [0])
            kids = children[node + 1]
            if p.is_greedy:
                t = int(greedy_ids(row)[0])
                child = next((c for c in kids if draft[c] == t), None)
            else:
                probs = target_probs(row, p.temperature, p.top_k, p.top_p, p.min_p)[0]
                if chain:
                    x = draft[kids[0]] if kids else None
                    t = sample_row(probs, x, uniforms[len(out)])
                    child = kids[0] if kids and t == x else None
                else:
                    t, rank = sample_tree_row(probs, [draft[c] for c in kids], uniforms, len(out))
                    child = None if rank is None else kids[rank]
            out.append(t)
            grammar.accept(t)
            if child is None or grammar.terminated or grammar.rejected_token is not None:
                return out, path
            path.append(child)
            node = child

    # --------------------------------------------------------------- lifetime
    def release(self, req: Req) -> None:
        self.proposer.release(req.rid)
        self.rule.release(req.rid)

    def close(self) -> None:
        self.proposer.close()


def _chain(draft) -> list[int]:
    """The draft's first chain (from the fed token, each node's first child): what a backend that
    cannot mask a tree verifies."""
    out: list[int] = []
    node = -1
    for j, parent in enumerate(draft.parents):
        if parent == node:
            out.append(draft.tokens[j])
            node = j
    return out


def draft_nodes(draft, budget: int, trees: bool) -> tuple[list[int], list[int]]:
    """The draft's tokens and parents as the batch carries them: at most ``budget`` nodes (parents
    come before children, so the first nodes are a tree), or its first chain where trees are off."""
    if not trees:
        tokens = _chain(draft)[:budget]
        return tokens, chain_parents(len(tokens))
    return list(draft.tokens[:budget]), list(draft.parents[:budget])
