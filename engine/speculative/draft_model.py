"""STANDALONE: a draft model guesses the next tokens by greedy decoding over its own small KV pool.

The registry builds this proposer for a separate draft checkpoint (``--speculative-draft-model-path``,
whose architecture may differ from the target's); the target's own checkpoint in a cheaper form
drafts over the target's KV instead (``self_draft.py``), though this class still runs it with a
pool of its own when built directly.

The draft is ``speculative_draft_model_path`` (a checkpoint with the target's tokenizer), or, when
that is None, the target's own checkpoint in ``speculative_draft_quantization`` (``w8a16``: int8
weights, half the bytes a step streams; a cheaper self-draft needing no second checkpoint). It is
an ordinary ``ModelRunner`` in this process, built from a derived ``EngineConfig``
(``draft_engine_config``): speculation off, no radix or hierarchical cache, a pool of its own.

Per request the proposer keeps the tokens whose K/V the draft's pool holds and their pages
(``_DraftSeq``). Each ``propose``:

1. truncates every request's draft KV to the common prefix with its ``token_ids`` (what the
   target rejected lies past it; whole pages past the prefix go back to the pool),
2. catches the draft up on the tokens it has not seen (the accepted drafts, the bonus token, or the
   whole prompt the first time) in extend forwards batched across the requests, at most
   ``CATCH_UP_TOKENS`` per call (a long new prompt over several calls, drafting nothing meanwhile),
3. runs ``max_tokens - 1`` greedy decode steps batched across the requests still drafting,
   and returns each request's picks as a chain.

The last draft token is never fed (its K/V would only matter if every guess were accepted, and
then the next call's catch-up writes it), so a request holds ``len(token_ids) + max_tokens - 1``
slots. When the pool cannot hold them, that request gets an empty draft (no guess) and its draft
KV is dropped, so the pages go to the others: speculation degrades, it never fails a request.

Under tensor parallelism the draft's ``ModelRunner`` joins the process's TP group like the
target's: every rank runs the same draft steps in lockstep on its shard, as it runs the target.
Under DP attention the draft's steps are draft rounds (``ModelRunner.draft_of``): the other groups
answer them with the draft's idle forward, never the target's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.model_executor.parallel import all_reduce_min
from pdserve.engine.speculative.proposer import Draft, DraftInput, chains_at
from pdserve.engine.speculative_names import STANDALONE

logger = logging.getLogger(__name__)


def draft_engine_config(config: EngineConfig, pool_tokens: int) -> EngineConfig:
    """The draft model's EngineConfig: the target's flags, with the draft's checkpoint and weights,
    speculation and the prefix caches off, and a pool of ``pool_tokens`` tokens."""
    own_checkpoint = config.speculative_draft_model_path is not None
    quantization = config.speculative_draft_quantization or config.quantization
    return dataclasses.replace(
        config,
        model_path=config.speculative_draft_model_path if own_checkpoint else config.model_path,
        tokenizer_path=None if own_checkpoint else config.tokenizer_path,  # its own, to check it is the target's
        quantization=quantization,
        max_total_tokens=pool_tokens, mem_fraction_static=None,
        disable_radix_cache=True, schedule_policy="fcfs", enable_hierarchical_cache=False,
        hicache_storage_backend=None, hicache_storage_backend_extra_config=None,
        speculative_algorithm=None, speculative_num_draft_tokens=EngineConfig.speculative_num_draft_tokens,
        speculative_draft_model_path=None, speculative_draft_quantization=None,
    )


def draft_pool_tokens(config: EngineConfig, target_pool_tokens: int) -> int:
    """The draft's pool: every token the target's pool can hold (the draft mirrors only running
    requests, a subset) plus, per running request, its draft tokens and a partly filled page."""
    return target_pool_tokens + config.max_running_requests * (config.speculative_num_draft_tokens
                                                              + config.page_size)


def check_same_vocabulary(draft: ModelRunner, target: ModelRunner, draft_path: str | None) -> None:
    """Raise ValueError naming speculative_draft_model_path unless the draft's model has the target's
    vocabulary size and its tokenizer gives every token of the target's tokenizer the same id (its
    guesses must mean the target's tokens; tokens only the draft's tokenizer adds, such as a special
    token past the model's vocabulary, are not compared)."""
    where = f"speculative_draft_model_path {draft_path!r}" if draft_path else "the self-draft"
    if draft.arch.vocab_size != target.arch.vocab_size:
        raise ValueError(f"{where} has a vocabulary of {draft.arch.vocab_size} tokens, the target model "
                         f"{target.arch.vocab_size}: a draft model must share the target's tokenizer")
    draft_vocab, target_vocab = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    differ = sum(1 for tok, i in target_vocab.items() if draft_vocab.get(tok) != i)
    if differ:
        raise ValueError(f"{where} has another tokenizer than the target model ({differ} of the target's "
                         f"{len(target_vocab)} tokens have another id or none): a draft model must share the "
                         "target's tokenizer")


def draft_group_rows(runner: ModelRunner) -> int:
    """The most rows a draft step of ``runner`` takes at once (0: any): int8 weights where larger
    steps dequantize every matrix (no AMX), so a step of more rows than gemv takes costs several
    times more than two steps of gemv's size; the draft's small steps go in groups of gemv's rows."""
    plan = runner.model.plan
    return plan.gemv_rows if plan.quantized and plan.gemv_rows and not plan.w8_amx else 0


# draft tokens caught up per propose call, over all its requests: a new request's prompt is taken in
# slices of this over several steps rather than in one long forward inside a decode step
CATCH_UP_TOKENS = 256
COST_PAIRS = 5  # timed decode steps of each model at start, taking turns (after one untimed each)
COST_CONTEXT = 32  # tokens of the scratch sequence they decode over


class ScratchDecode:
    """Decode steps at one sequence of ``COST_CONTEXT`` tokens on scratch pages of ``runner``'s pool
    (at start, before any request); ``close`` gives the pages back."""

    def __init__(self, runner: ModelRunner, steps: int):
        """Room for ``steps`` more tokens after the untimed first ones."""
        self.runner, self.pool = runner, runner.page_pool
        self.n = max(1, min(COST_CONTEXT, self.pool.max_total_tokens - steps - 4))
        self.pages = self.pool.alloc(self.pool.pages_for(self.n + steps + 4))
        self.table = torch.tensor([self.pages], dtype=torch.int32)
        self._forward(0, self.n)
        self.pos = self.n

    def _forward(self, start: int, count: int) -> None:
        ps = self.pool.page_size
        pos = list(range(start, start + count))
        batch = ForwardBatch(input_ids=torch.full((count,), 1 + start % 7, dtype=torch.int64),
                             positions=torch.tensor(pos),
                             out_cache_loc=torch.tensor([self.pages[p // ps] * ps + p % ps for p in pos]),
                             page_table=self.table, logits_indices=torch.tensor([count - 1]), extend_lens=[count],
                             seq_lens=[start + count])
        float(self.runner.forward(batch)[0, 0])  # on a device, waits for the step

    def step_s(self, count: int = 1) -> float:
        """One step feeding ``count`` tokens (1: a decode step)."""
        t0 = time.perf_counter()
        self._forward(self.pos, count)
        self.pos += count
        return time.perf_counter() - t0

    def close(self) -> None:
        self.pool.free(self.pages)


def relative_step_cost(draft: ModelRunner, target: ModelRunner, k: int) -> float:
    """What one draft token costs, in target decode steps at one sequence, measured once at start.

    A propose call of ``k`` tokens is the draft's real cycle: one step feeding the tokens the
    verify kept since the last call (the bonus token and the last accepted draft: 2) whose last
    row gives the first guess, then ``k - 1`` decode steps; its time over ``k`` target decode
    steps. A 2-token step is not a decode step (no fused decode, and on int8 weights without AMX
    possibly a dequantizing product), so timing decode steps alone underprices a guess. The median
    over ``COST_PAIRS`` cycles taken in turns with the target's steps (on a shared machine the load
    moves within seconds; adjacent ones see the same). Under TP the largest any rank measured (in
    thousandths), so every rank's adaptive rule prices a guess alike."""
    d, t = ScratchDecode(draft, (COST_PAIRS + 1) * (k + 1)), ScratchDecode(target, (COST_PAIRS + 1) * k)

    def cycle() -> float:
        return d.step_s(2) + sum(d.step_s() for _ in range(k - 1))

    try:
        cycle(), t.step_s()  # untimed: first steps pay one-time costs
        ratios = sorted(cycle() / max(sum(t.step_s() for _ in range(k)), 1e-9) for _ in range(COST_PAIRS))
    finally:
        d.close()
        t.close()
    cost = ratios[COST_PAIRS // 2]
    return -all_reduce_min(-round(min(cost, 8.0) * 1000)) / 1000


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: list comparisons (C speed) in a binary search,
    not a Python loop over a long context at every step."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class _DraftSeq:
    """One request's state in the draft: ``tokens[i]``'s K/V sit at position i of ``pages``."""

    tokens: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)


@dataclass
class _Job:
    """A request drafting in this call: catch up ``ids[done:]``, then draft ``k`` tokens."""

    index: int  # in the call's inputs
    seq: _DraftSeq
    ids: list[int]
    done: int
    k: int
    end: int = 0  # this call catches up ids[done:end]; drafting needs end == len(ids)
    picks: list[int] = field(default_factory=list)


class DraftModelProposer:
    """The STANDALONE proposer (``proposer.Proposer``). ``target_runner``: the target's
    ModelRunner, whose vocabulary the draft must share and whose pool sizes the draft's."""

    name = STANDALONE
    wants_hidden = False

    def __init__(self, config: EngineConfig, target_runner: ModelRunner):
        t0 = time.perf_counter()
        pool_tokens = draft_pool_tokens(config, target_runner.page_pool.max_total_tokens)
        # a draft that fails to load raises here, at start, never at the first request
        self.runner = ModelRunner(draft_engine_config(config, pool_tokens))
        self.runner.draft_of(target_runner)  # under DP attention its steps are draft rounds
        check_same_vocabulary(self.runner, target_runner, config.speculative_draft_model_path)
        self.pool = self.runner.page_pool
        self.page_size = self.pool.page_size
        self.max_context = self.runner.arch.max_context_len
        self.chunk = config.chunked_prefill_size  # the most tokens one catch-up forward takes
        self.group_rows = draft_group_rows(self.runner)  # a long catch-up goes whole
        self._seqs: dict[str, _DraftSeq] = {}
        # what one draft token costs, in target decode steps: the adaptive rule's price of a guess
        self.cost_per_token = relative_step_cost(self.runner, target_runner, config.speculative_num_draft_tokens)
        logger.info("STANDALONE draft %s (%s) ready in %.1fs, %d-token pool; a draft step costs %.2f of "
                    "the target's", self.runner.model_source.path, self.runner.config.quantization,
                    time.perf_counter() - t0, self.pool.max_total_tokens, self.cost_per_token)

    # ------------------------------------------------------------- proposer
    def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        jobs = self._admit(inputs)
        if jobs:
            self._catch_up(jobs)
            self._decode(jobs)
        return chains_at(len(inputs), ((job.index, job.picks) for job in jobs))

    def release(self, rid: str) -> None:
        seq = self._seqs.pop(rid, None)
        if seq is not None:
            self.pool.free(seq.pages)

    def close(self) -> None:
        for rid in list(self._seqs):
            self.release(rid)
        self.runner.release_weights()

    def check_integrity(self) -> None:
        """The pool's pages in use are exactly the requests' pages, each owned once."""
        self.pool.check_integrity()
        owned = [p for seq in self._seqs.values() for p in seq.pages]
        if len(owned) != len(set(owned)) or set(owned) != self.pool.used_pages():
            raise AssertionError(f"draft pool: {len(owned)} pages owned by requests, "
                                 f"{self.pool.num_used} in use")

    @property
    def num_requests(self) -> int:
        return len(self._seqs)

    # ------------------------------------------------------------- steps
    def _admit(self, inputs: Sequence[DraftInput]) -> list[_Job]:
        """Truncate each request's draft KV to what still matches, then give it the pages its
        catch-up and drafts need; one that cannot have them drafts nothing and drops its KV."""
        plans = []
        for i, inp in enumerate(inputs):  # all truncations first: rejected pages free room for any
            ids = list(inp.token_ids)
            seq = self._seqs.setdefault(inp.rid, _DraftSeq())
            # the last token is always fed again: its logits give the first guess
            keep = min(common_prefix_len(seq.tokens, ids), len(ids) - 1)
            self._truncate(seq, max(keep, 0))
            k = min(inp.max_tokens, self.max_context - len(ids))
            if ids and k >= 1:
                plans.append((i, inp.rid, seq, ids, k))
        jobs = []
        for i, rid, seq, ids, k in plans:
            need = self.pool.pages_for(len(ids) + k - 1) - len(seq.pages)
            if need > self.pool.num_free:
                self.release(rid)  # the pool is full: no guess, and its pages to the others
                continue
            seq.pages += self.pool.alloc(max(need, 0))
            jobs.append(_Job(i, seq, ids, len(seq.tokens), k))
        return jobs

    def _truncate(self, seq: _DraftSeq, n: int) -> None:
        del seq.tokens[n:]
        keep_pages = self.pool.pages_for(n)
        if len(seq.pages) > keep_pages:
            self.pool.free(seq.pages[keep_pages:])
            del seq.pages[keep_pages:]

    def _catch_up(self, jobs: list[_Job]) -> None:
        """Extend forwards of at most ``chunk`` tokens over the requests' unseen tokens, at most
        ``CATCH_UP_TOKENS`` in all per call (the requests with the fewest first), so a new long prompt
        never stalls the step it joins: a request not caught up by the budget drafts nothing this
        call and goes on from where it stopped. A caught-up request's first guess comes from the row
        of its last token."""
        left = CATCH_UP_TOKENS
        for job in sorted(jobs, key=lambda j: len(j.ids) - j.done):
            job.end = job.done + min(len(job.ids) - job.done, left)
            left -= job.end - job.done
        pending = [job for job in jobs if job.done < job.end]
        while pending:
            rows, budget = [], self.chunk
            for job in pending:
                if budget == 0:
                    break
                n = min(job.end - job.done, budget)
                rows.append((job, job.done, job.ids[job.done : job.done + n]))
                budget -= n
            sampled = [job for job, start, new in rows if start + len(new) == len(job.ids)]
            logits = self._forward_groups(rows, [start + len(new) == len(job.ids) for job, start, new in rows])
            for job, start, new in rows:
                job.seq.tokens.extend(new)
                job.done = start + len(new)
            for job, pick in zip(sampled, self._argmax(logits)):
                job.picks.append(pick)
            pending = [job for job in pending if job.done < job.end]

    def _decode(self, jobs: list[_Job]) -> None:
        """Greedy decode steps, batched over the caught-up requests that still want more draft tokens."""
        while True:
            active = [job for job in jobs if job.picks and len(job.picks) < job.k]
            if not active:
                return
            rows = [(job, len(job.seq.tokens), [job.picks[-1]]) for job in active]
            logits = self._forward_groups(rows, [True] * len(rows))
            for job, pick in zip(active, self._argmax(logits)):
                job.seq.tokens.append(job.picks[-1])
                job.picks.append(pick)

    def _forward_groups(self, rows: list[tuple[_Job, int, list[int]]], sample: list[bool]) -> torch.Tensor:
        """``_forward`` over consecutive groups of at most ``group_rows`` tokens (all at once when 0)."""
        if not self.group_rows or sum(len(new) for _, _, new in rows) <= self.group_rows:
            return self._forward(rows, sample)
        outs, group, tokens = [], [], 0
        for i, (_, _, new) in enumerate(rows):
            if group and tokens + len(new) > self.group_rows:
                outs.append(self._forward([rows[j] for j in group], [sample[j] for j in group]))
                group, tokens = [], 0
            group.append(i)
            tokens += len(new)
        outs.append(self._forward([rows[j] for j in group], [sample[j] for j in group]))
        return torch.cat(outs)

    def _forward(self, rows: list[tuple[_Job, int, list[int]]], sample: list[bool]) -> torch.Tensor:
        """One ragged step: per row (job, first position, new tokens); logits of the sampled rows' last tokens."""
        ps = self.page_size
        ids, positions, slots, logits_rows, seq_lens = [], [], [], [], []
        for (job, start, new), want in zip(rows, sample):
            pages = job.seq.pages
            end = start + len(new)
            ids.extend(new)
            positions.extend(range(start, end))
            slots.extend(pages[p // ps] * ps + p % ps for p in range(start, end))
            if want:
                logits_rows.append(len(ids) - 1)
            seq_lens.append(end)
        width = max(self.pool.pages_for(n) for n in seq_lens)
        page_table = torch.tensor([job.seq.pages[:width] + [0] * (width - len(job.seq.pages[:width]))
                                   for job, _, _ in rows], dtype=torch.int32)
        i64 = dict(dtype=torch.int64)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, **i64), positions=torch.tensor(positions, **i64),
            out_cache_loc=torch.tensor(slots, **i64), page_table=page_table,
            logits_indices=torch.tensor(logits_rows, **i64), extend_lens=[len(new) for _, _, new in rows],
            seq_lens=seq_lens,
        )
        return self.runner.forward(batch)  # [len(logits_rows), vocab] float32

    @staticmethod
    def _argmax(logits: torch.Tensor) -> list[int]:
        return logits.argmax(dim=-1).tolist()
