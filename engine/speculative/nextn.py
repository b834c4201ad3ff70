"""NEXTN: DeepSeek's multi-token-prediction layer drafts from the target's hidden states.

The draft head is the checkpoint's own MTP layer (``models/deepseek_mtp.py``). Its position p
reads the target's final-normed hidden state h_p and the token t_{p+1}; its output there guesses
t_{p+2}. So the MTP needs the target's hidden state at every position it covers: the proposer
``wants_hidden``, and after every target step of a speculating request ``Speculation.observe``
hands it the hidden rows the step made valid (``observe``): the prefill's (every chunk's rows),
a plain decode step's one row, a verify step's fed token and accepted drafts. Rows at a position
the MTP had already covered replace what it had there (the rejected drafts' positions).

Per request it keeps ``_MTPSeq``: ``base``, the first target position it has a hidden state
for (0 after a full prefill; later where a cached prefix was reused, whose positions the target
did not compute), how many positions its KV holds, and the hidden rows not yet run. ``propose``
runs the pending rows in extend forwards (the "catch-up", whose last row gives the first guess),
then chains ``k - 1`` decode steps, each feeding its guess with the MTP's own output hidden state.
The MTP's rope positions count from ``base`` (rope attention sees only relative positions).

The MTP's K/V go to a one-layer latent pool of its own, not into the target's pages: they are
another layer's values (for (h_p, t_{p+1}), not t_p), and a layer more in the target's pool would
change its layout for every request, the PD transfer and the pool sizing with it; a one-layer
pool is a 1/num_layers share of the target's, mirrors only speculating requests, and its pages
go back with the request (``release``). When it cannot hold a request's slots, that request
drafts nothing and drops its MTP state (which restarts at the next position observed).

On a PD decode the prompt's MTP rows come from the prefill, in the last layer of the target's
pages (``nextn_prompt.py``); ``observe_prompt`` copies them into this pool with the last prompt
position's hidden state pending, the state a colocated MTP has before its prompt's catch-up ends.

Under tensor parallelism every rank runs the same MTP steps on its shard in lockstep, as the target.
Under DP attention each MTP step opens a draft round (``ModelRunner.join_draft_round``): the MTP's MLP
runs over every group's rows, and the groups not drafting answer with the MTP's idle forward.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.model_executor.models.deepseek_mtp import DeepseekMTP
from pdserve.engine.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
from pdserve.engine.model_executor.parallel import all_reduce_min
from pdserve.engine.speculative.draft_model import COST_PAIRS, ScratchDecode, draft_pool_tokens
from pdserve.engine.speculative.nextn_handoff import PromptKV
from pdserve.engine.speculative.proposer import Draft, DraftInput, chains_at
from pdserve.engine.speculative_names import NEXTN

logger = logging.getLogger(__name__)


@dataclass
class _MTPSeq:
    """A request's MTP state: KV slot m holds target position ``base + m`` for m < ``done``;
    ``pending`` [n, hidden]: the target's hidden states at positions ``base + done ..``, not yet run."""

    base: int
    done: int = 0
    pending: torch.Tensor | None = None
    pages: list[int] = field(default_factory=list)

    @property
    def known(self) -> int:
        """One past the last target position whose hidden state it holds or has run."""
        return self.base + self.done + (0 if self.pending is None else self.pending.shape[0])


@dataclass
class _Job:
    index: int  # in the call's inputs
    seq: _MTPSeq
    ids: Sequence[int]
    k: int
    picks: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [hidden] the MTP's output at its last position


class NextNProposer:
    """The NEXTN proposer (``proposer.Proposer``) over ``target_runner``'s DeepSeek model."""

    name = NEXTN
    wants_hidden = True

    def __init__(self, config: EngineConfig, target_runner: ModelRunner):
        t0 = time.perf_counter()
        target = target_runner.model
        if not isinstance(target, DeepseekV2ForCausalLM):
            raise ValueError(f"speculative_algorithm NEXTN drafts with a DeepSeek-V2/V3 checkpoint's MTP layers; "
                             f"{target_runner.arch.arch} has none")
        self.mtp = DeepseekMTP(target, target_runner.model_source.path)
        # under DP attention each MTP step is a draft round, answered by the other groups' idle MTP
        target_runner.add_draft(self.mtp.idle_forward)
        self.target_runner = target_runner
        target.keep_hidden = True
        self.target = target
        self.device = target_runner.device
        ps = config.page_size
        tokens = draft_pool_tokens(config, target_runner.page_pool.max_total_tokens)
        arch = target_runner.arch
        self.pool = PagePool(-(-tokens // ps) + 1, ps, 1, 1, arch.head_dim, target_runner.dtype, self.device,
                             kind=arch.kv_kind)
        self.page_size = ps
        self.max_context = arch.max_context_len
        self.chunk = config.chunked_prefill_size  # the most rows of one catch-up forward
        self._seqs: dict[str, _MTPSeq] = {}
        self.cost_per_token = self._step_cost(target_runner, config.speculative_num_draft_tokens)
        logger.info("NEXTN: the MTP layer of %s ready in %.1fs, %d-token pool; a draft step costs %.2f of the "
                    "target's", target_runner.model_source.path, time.perf_counter() - t0,
                    self.pool.max_total_tokens, self.cost_per_token)

    # ------------------------------------------------------------- hidden states
    def observe(self, rid: str, start: int, hidden: torch.Tensor) -> None:
        """The target's final-normed hidden states [n, hidden] at positions ``start ..`` of ``rid``."""
        seq = self._seqs.get(rid)
        if seq is None or start < seq.base or start > seq.known:
            # new, restarted, or a gap it has no hidden state for: start over from here
            self.release(rid)
            seq = self._seqs[rid] = _MTPSeq(start)
        keep_done = min(seq.done, start - seq.base)
        kept = seq.pending[: max(start - seq.base - seq.done, 0)] if seq.pending is not None else None
        seq.done = keep_done
        rows = hidden.detach().clone()
        seq.pending = rows if kept is None or kept.shape[0] == 0 else torch.cat([kept, rows])

    def observe_prompt(self, rid: str, prompt: PromptKV, hidden: torch.Tensor) -> None:
        """A PD decode's request: the MTP's KV of positions ``0 .. prompt.count - 1`` as the prefill
        computed it (``nextn_prompt.py``), and the target's hidden state [1, hidden] at
        ``prompt.count`` (the prompt's last position). Its pages are copied into this pool, so the MTP
        goes on as a colocated one after its prompt's catch-up; when they do not fit, it starts
        from the hidden state alone (``observe``)."""
        if prompt.pool.page_size != self.page_size:
            raise ValueError(f"prompt KV in pages of {prompt.pool.page_size} tokens, the MTP's are {self.page_size}")
        self.release(rid)
        n = self.pool.pages_for(prompt.count)
        if n > self.pool.num_free:
            self.observe(rid, prompt.count, hidden)
            return
        seq = self._seqs[rid] = _MTPSeq(0, done=prompt.count, pages=self.pool.alloc(n))
        if n:
            dst = torch.tensor(seq.pages, dtype=torch.int64, device=self.device)
            src = torch.tensor(prompt.pages[:n], dtype=torch.int64, device=self.device)
            # [heads, pages, page_size, width]: whole pages (slots past count are rewritten before read)
            self.pool.k[0].index_copy_(1, dst, prompt.pool.k[prompt.layer].index_select(1, src))
        seq.pending = hidden.detach().clone()

    # ------------------------------------------------------------- proposer
    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        jobs = []
        for i, inp in enumerate(inputs):
            seq = self._seqs.get(inp.rid)
            ids = inp.token_ids
            last = len(ids) - 1  # the position fed next: its hidden state comes with that step
            k = min(inp.max_tokens, self.max_context - len(ids))
            if seq is None or seq.pending is None or seq.pending.shape[0] == 0 or seq.known != last or k < 1:
                continue
            need = self.pool.pages_for(seq.known - seq.base + k - 1) - len(seq.pages)
            if need > self.pool.num_free:
                self.release(inp.rid)  # the pool is full: no guess, and its pages to the others
                continue
            seq.pages += self.pool.alloc(max(need, 0))
            jobs.append(_Job(i, seq, ids, k))
        if jobs:
            self._catch_up(jobs)
            self._chain(jobs)
        return chains_at(len(inputs), ((job.index, job.picks) for job in jobs))

    def release(self, rid: str) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            self.pool.free(seq.pages)

    def close(self) -> None:
        for rid in list(self._seqs):
            self.release(rid)
        self.target.keep_hidden = False

    def check_integrity(self) -> None:
        """The pool's pages in use are exactly the requests' pages, each owned once."""
        self.pool.check_integrity()
        owned = [p for seq in self._seqs.values() for p in seq.pages]
        if len(owned) != len(set(owned)) or set(owned) != self.pool.used_pages():
            raise AssertionError(f"NEXTN pool: {len(owned)} pages owned by requests, {self.pool.num_used} in use")

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    # ------------------------------------------------------------- steps
    def _catch_up(self, jobs: list[_Job]) -> None:
        """Run every job's pending rows (in forwards of at most ``chunk`` rows per job); the last
        row of each gives the job's first guess and the hidden state its chain goes on from."""
        while True:
            rows = []
            for job in jobs:
                seq = job.seq
                if seq.pending is None or seq.pending.shape[0] == 0:
                    continue
                n = min(seq.pending.shape[0], self.chunk)
                m0 = seq.done
                tokens = [job.ids[seq.base + m + 1] for m in range(m0, m0 + n)]
                rows.append((job, m0, tokens, seq.pending[:n], n == seq.pending.shape[0]))
            if not rows:
                return
            logits, out = self._forward([(job.seq, m0, tokens) for job, m0, tokens, _, _ in rows],
                                        torch.cat([h for _, _, _, h, _ in rows]))
            end = 0
            for r, (job, m0, tokens, h, last) in enumerate(rows):
                end += len(tokens)
                seq = job.seq
                seq.done += len(tokens)
                seq.pending = seq.pending[len(tokens):]
                if last:
                    job.picks.append(int(logits[r].argmax()))
                    job.hidden = out[end - 1]

    def _chain(self, jobs: list[_Job]) -> None:
        """Decode steps feeding each job's last guess with the MTP's last output hidden state, into
        the slots past its KV (the next catch-up overwrites them)."""
        while True:
            active = [job for job in jobs if job.picks and len(job.picks) < job.k]
            if not active:
                return
            logits, out = self._forward([(job.seq, job.seq.done + len(job.picks) - 1, [job.picks[-1]])
                                         for job in active], torch.stack([job.hidden for job in active]))
            for r, job in enumerate(active):
                job.picks.append(int(logits[r].argmax()))
                job.hidden = out[r]

    def _forward(self, rows: list[tuple[_MTPSeq, int, list[int]]], hidden: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One ragged MTP step: per row (seq, first MTP slot, tokens); the last token's logits per row."""
        ps = self.page_size
        ids, positions, slots, last, seq_lens = [], [], [], [], []
        for seq, m0, tokens in rows:
            ids.extend(tokens)
            positions.extend(range(m0, m0 + len(tokens)))
            slots.extend(seq.pages[m // ps] * ps + m % ps for m in range(m0, m0 + len(tokens)))
            last.append(len(ids) - 1)
            seq_lens.append(m0 + len(tokens))
        width = max(self.pool.pages_for(n) for n in seq_lens)
        table = [seq.pages[:width] + [0] * (width - len(seq.pages[:width])) for seq, _, _ in rows]
        dev, i64 = self.device, dict(dtype=torch.int64, device=self.device)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, **i64), positions=torch.tensor(positions, **i64),
            out_cache_loc=torch.tensor(slots, **i64), page_table=torch.tensor(table, dtype=torch.int32, device=dev),
            logits_indices=torch.tensor(last, **i64), extend_lens=[len(t) for _, _, t in rows], seq_lens=seq_lens,
        )
        with torch.inference_mode():
            self.target_runner.join_draft_round(len(ids), len(last))
            return self.mtp.forward(batch, self.pool, hidden)

    def _step_cost(self, target_runner: ModelRunner, k: int) -> float:
        """What one draft token costs, in target decode steps at one sequence, measured at start:
        ``k`` MTP decode steps against ``k`` of the target, taking turns ``COST_PAIRS`` times, the
        fastest cycle of each (as ``self_draft.decode_step_cost``). Under TP the largest any rank measured."""
        steps = (COST_PAIRS + 1) * k
        seq = _MTPSeq(0, pages=self.pool.alloc(self.pool.pages_for(steps + 1)))
        t = ScratchDecode(target_runner, steps)
        h = torch.zeros(1, self.mtp.hidden_size, dtype=target_runner.dtype, device=self.device)

        def mtp_step() -> float:
            t0 = time.perf_counter()
            logits, _ = self._forward([(seq, seq.done, [1])], h)
            float(logits[0, 0])
            seq.done += 1
            return time.perf_counter() - t0

        try:
            mtp_step(), t.step_s()  # untimed: first steps pay one-time costs
            mtp_s, target_s = [], []
            for _ in range(COST_PAIRS):
                mtp_s.append(sum(mtp_step() for _ in range(k)))
                target_s.append(sum(t.step_s() for _ in range(k)))
        finally:
            self.pool.free(seq.pages)
            t.close()
        cost = min(mtp_s) / max(min(target_s), 1e-9)
        return -all_reduce_min(-round(min(cost, 8.0) * 1000)) / 1000


def nextn_proposer(config: EngineConfig, target_runner: ModelRunner) -> NextNProposer:
    return NextNProposer(config, target_runner)
