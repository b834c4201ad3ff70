"""STANDALONE self-draft: the target's own checkpoint in a cheaper form, drafting over the target's KV.

When ``--speculative-draft-model-path`` is not given, the draft is the target model itself with
other weights (``--speculative-draft-quantization w8a16``): the same architecture and KV layout.
Its ``ModelRunner`` is built over the target's page pool (``ModelRunner(page_pool=...)``), so it
needs no pool of its own and never catches up on a prompt: the prefix it attends over is the
target's K/V, already there (on the decode side of PD too, where it came from the prefill).

Per drafting request (``DraftInput.pages`` and ``kv_len``, whose pages the scheduler reserved for
``kv_len + 1 + max_tokens`` tokens before asking: ``Speculation.attach``), ``propose`` runs
``max_tokens`` greedy decode steps batched across the requests: the first feeds the request's last
token (position ``kv_len``, which has no K/V yet), each next one the previous pick, every step a
single-token decode row through the draft's fused native path, writing its K/V into the request's
own slots ``kv_len ..``. The verify forward then feeds the same last token and drafts at the same
positions and overwrites every one of those slots with the target's K/V; slots past what the
verify feeds lie past the sequence's length, to be written by whatever step feeds them. So the KV
a request keeps is always the target's, exactly, and greedy output stays plain decoding's.

Under tensor parallelism the draft's runner joins the TP group like the target's and shares each
rank's pool shard: every rank runs the same draft steps in lockstep. Under DP attention its steps
are draft rounds (``ModelRunner.draft_of``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.model_executor.parallel import all_reduce_min
from pdserve.engine.speculative.draft_model import (COST_PAIRS, ScratchDecode, check_same_vocabulary,
                                                    draft_engine_config, draft_group_rows)
from pdserve.engine.speculative.proposer import Draft, DraftInput, chains_at
from pdserve.engine.speculative_names import STANDALONE

logger = logging.getLogger(__name__)


def decode_step_cost(draft: ModelRunner, target: ModelRunner, k: int) -> float:
    """What one draft token costs, in target decode steps at one sequence, measured at start: the
    self-draft's cycle is ``k`` decode steps of the draft, timed against ``k`` of the target, taking
    turns ``COST_PAIRS`` times; the fastest cycle of each over the fastest of the other (a server
    starts beside others loading: on a shared CPU a step's time only ever grows by waiting, so the
    fastest is the step's own cost, where a median of ratios still moved 0.6-1.3 under load). Under
    TP the largest any rank measured."""
    d, t = ScratchDecode(draft, (COST_PAIRS + 1) * k), ScratchDecode(target, (COST_PAIRS + 1) * k)
    try:
        d.step_s(), t.step_s()  # untimed: first steps pay one-time costs
        draft_s, target_s = [], []
        for _ in range(COST_PAIRS):
            draft_s.append(sum(d.step_s() for _ in range(k)))
            target_s.append(sum(t.step_s() for _ in range(k)))
    finally:
        d.close()
        t.close()
    cost = min(draft_s) / max(min(target_s), 1e-9)
    return -all_reduce_min(-round(min(cost, 8.0) * 1000)) / 1000


@dataclass
class _Job:
    index: int  # in the call's inputs
    pages: Sequence[int]
    start: int  # kv_len: the position of the request's last token
    k: int
    picks: list[int] = field(default_factory=list)


class SharedKVDraftProposer:
    """The STANDALONE proposer of a self-draft (``proposer.Proposer``), over ``target_runner``'s pool."""

    name = STANDALONE
    wants_hidden = False
    # ``Speculation.attach`` reserves each request's draft slots and passes its pages and kv_len
    shares_target_kv = True

    def __init__(self, config: EngineConfig, target_runner: ModelRunner):
        if config.speculative_draft_model_path is not None:
            raise ValueError("a draft sharing the target's KV is the target's own checkpoint: "
                             "speculative_draft_model_path must be unset")
        t0 = time.perf_counter()
        self.pool = target_runner.page_pool
        # a draft that fails to load raises here, at start, never at the first request
        self.runner = ModelRunner(draft_engine_config(config, self.pool.max_total_tokens), page_pool=self.pool)
        self.runner.draft_of(target_runner)  # under DP attention its steps are draft rounds
        check_same_vocabulary(self.runner, target_runner, None)
        self.page_size = self.pool.page_size
        self.max_context = self.runner.arch.max_context_len
        self.group_rows = draft_group_rows(self.runner)
        self.cost_per_token = decode_step_cost(self.runner, target_runner, config.speculative_num_draft_tokens)
        logger.info("STANDALONE self-draft (%s) over the target's KV ready in %.1fs; a draft step costs %.2f "
                    "of the target's", self.runner.config.quantization, time.perf_counter() - t0,
                    self.cost_per_token)

    # ------------------------------------------------------------- proposer
    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        jobs = []
        for i, inp in enumerate(inputs):
            if inp.pages is None or inp.kv_len is None:
                raise ValueError("a draft over the target's KV needs each request's pages and kv_len")
            if inp.kv_len != len(inp.token_ids) - 1:
                raise ValueError(f"request {inp.rid}: kv_len {inp.kv_len} is not its tokens but the last "
                                 f"({len(inp.token_ids) - 1})")
            k = min(inp.max_tokens, self.max_context - len(inp.token_ids),
                    len(inp.pages) * self.page_size - inp.kv_len)
            if k >= 1:
                jobs.append(_Job(i, inp.pages, inp.kv_len, k))
        last = [inp.token_ids[-1] for inp in inputs]
        while True:
            active = [job for job in jobs if len(job.picks) < job.k]
            if not active:
                break
            fed = [job.picks[-1] if job.picks else last[job.index] for job in active]
            for job, pick in zip(active, self._forward_groups(active, fed)):
                job.picks.append(pick)
        return chains_at(len(inputs), ((job.index, job.picks) for job in jobs))

    def release(self, rid: str) -> None:
        """Nothing is held per request: the draft's K/V live in the request's own slots."""

    def close(self) -> None:
        self.runner.release_weights()

    def check_integrity(self) -> None:
        """No pages of its own: the scheduler's check covers the shared pool."""

    @property
    def num_requests(self) -> int:
        return 0

    # ------------------------------------------------------------- steps
    def _forward_groups(self, jobs: list[_Job], fed: list[int]) -> list[int]:
        """One decode step of every job (its next token ``fed``), in groups of at most ``group_rows``."""
        n = self.group_rows or len(jobs)
        picks: list[int] = []
        for g in range(0, len(jobs), n):
            picks += self._forward(jobs[g : g + n], fed[g : g + n])
        return picks

    def _forward(self, jobs: list[_Job], fed: list[int]) -> list[int]:
        ps = self.page_size
        positions = [job.start + len(job.picks) for job in jobs]
        rows = [list(job.pages[: p // ps + 1]) for job, p in zip(jobs, positions)]
        width = max(len(r) for r in rows)
        i64 = dict(dtype=torch.int64)
        batch = ForwardBatch(
            input_ids=torch.tensor(fed, **i64), positions=torch.tensor(positions, **i64),
            out_cache_loc=torch.tensor([r[p // ps] * ps + p % ps for r, p in zip(rows, positions)], **i64),
            page_table=torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32),
            logits_indices=torch.arange(len(jobs)), extend_lens=[1] * len(jobs),
            seq_lens=[p + 1 for p in positions],
        )
        return self.runner.forward(batch).argmax(dim=-1).tolist()


def standalone_proposer(config: EngineConfig, target_runner: ModelRunner):
    """STANDALONE's factory: the self-draft over the target's KV, or a separate checkpoint
    (``speculative_draft_model_path``, whose architecture may differ) over a pool of its own."""
    if config.speculative_draft_model_path is None:
        return SharedKVDraftProposer(config, target_runner)
    from pdserve.engine.speculative.draft_model import DraftModelProposer

    return DraftModelProposer(config, target_runner)
