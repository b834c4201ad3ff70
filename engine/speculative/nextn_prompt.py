"""NEXTN through PD, on the prefill: the MTP layer's KV of the prompt, into the pages that go out.

Colocated, the proposer's catch-up runs the MTP over every prompt position before its first draft
(``nextn.py``). A PD decode never runs the prompt, so the prefill does it, as SGLang's prefill of an
EAGLE/MTP deployment runs the draft's extend: after each prefill forward, ``PromptMTP.run`` feeds
the MTP every row of the step whose next token is a prompt token (position p with p + 1 < P: the
target's final-normed hidden state h_p and the token t_{p+1}) and writes its KV into the last
layer of the target's pool (``nextn_handoff.mtp_kv_layers``), at the request's own slots. The
pages then carry it to the decode as any layer's (layer-wise: last, after the forward,
``then_mtp``). The row at P - 1 needs the first token, which the decode holds: its MTP runs that
row from the hidden state handed over in the aux slot.

Rope positions are the target's (a colocated MTP counts from 0 after a full prefill alike). A
prefix taken from the prefill's cache is not recomputed: its rows are those its pages hold (the
same tokens' rows, written by the request that computed them), except that the row at the cached
prefix's last position was computed with that request's next token, or never (the prompt's end):
a draft may then attend to a stale row there; the output never changes (the target verifies).

Under TP every rank runs the MTP on its shard in lockstep; the latent KV is equal on every rank.
Under DP attention the MTP's MLP (or experts) runs over every attention group's rows, so each
prompt-row forward opens a draft round as a NEXTN decode's draft step does
(``ModelRunner.join_draft_round``, no sampled rows); a group with no prompt rows answers it with the
MTP's idle forward (``ModelRunner.add_draft``), and while another group still runs target
forwards the draft round waits for them (answering them with the target's idle forward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.models.deepseek_mtp import DeepseekMTP


@dataclass(frozen=True)
class PromptRows:
    """One request's rows of a prefill step that the MTP runs: hidden rows ``row .. row + count - 1``
    of the step (batch order), at positions ``start ..``."""

    index: int  # the request's index in the batch
    row: int
    start: int
    count: int


def prompt_rows(prompt_lens: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> list[PromptRows]:
    """Per request of a prefill step (its prompt length P, the KV it had, the tokens this step
    computed), the rows whose next token is in the prompt: positions ``prefix .. min(prefix +
    extend, P - 1) - 1``. A last chunk of only the last prompt token has none."""
    out, row = [], 0
    for i, (p, s, n) in enumerate(zip(prompt_lens, prefix_lens, extend_lens)):
        count = min(s + n, p - 1) - s
        if count > 0:
            out.append(PromptRows(i, row, s, count))
        row += n
    return out


class PromptMTP:
    """The checkpoint's MTP layer on a PD prefill rank, writing the last layer of ``runner``'s pool
    (which holds the model's layers and this one: ``ModelRunner(extra_kv_layers=1)``)."""

    def __init__(self, runner):
        pool = runner.page_pool
        if pool.num_layers != runner.arch.num_layers + 1:
            raise ValueError(f"the prefill's MTP writes a pool layer past the model's {runner.arch.num_layers}; "
                             f"the pool has {pool.num_layers} (build the runner with extra_kv_layers=1)")
        self.layer = pool.num_layers - 1
        self.pool = pool
        self.target = runner.model
        self.device = runner.device
        self.mtp = DeepseekMTP(runner.model, runner.model_source.path, kv_layer=self.layer)
        # under DP attention each prompt-row forward is a draft round, answered by the other
        # groups' idle MTP forward
        runner.add_draft(self.mtp.idle_forward)
        self.runner = runner
        self.target.keep_hidden = True

    def run(self, reqs, prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> int:
        """After the target's forward of a prefill step (``reqs`` with their ``prefix_lens`` and
        ``extend_lens``): the MTP over its prompt rows; returns how many it ran."""
        rows = prompt_rows([r.prompt_len for r in reqs], prefix_lens, extend_lens)
        if not rows:
            return 0
        ps = self.pool.page_size
        hidden = self.target.last_hidden  # [num_tokens, hidden], the step's rows in batch order
        ids, positions, slots, seq_lens, parts = [], [], [], [], []
        for r in rows:
            req = reqs[r.index]
            span = range(r.start, r.start + r.count)
            ids.extend(req.input_ids[p + 1] for p in span)
            positions.extend(span)
            slots.extend(req.pages[p // ps] * ps + p % ps for p in span)
            seq_lens.append(r.start + r.count)
            parts.append(hidden[r.row : r.row + r.count])
        width = max(-(-n // ps) for n in seq_lens)
        table = [(reqs[r.index].pages[:width] + [0] * width)[:width] for r in rows]
        i64 = dict(dtype=torch.int64, device=self.device)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, **i64), positions=torch.tensor(positions, **i64),
            out_cache_loc=torch.tensor(slots, **i64),
            page_table=torch.tensor(table, dtype=torch.int32, device=self.device),
            logits_indices=torch.zeros(0, **i64), extend_lens=[r.count for r in rows], seq_lens=seq_lens,
        )
        with torch.inference_mode():
            self.runner.join_draft_round(len(ids), 0)
            self.mtp.forward(batch, self.pool, torch.cat(parts), logits=False)
        return len(ids)


@contextlib.contextmanager
def then_mtp(hook: contextlib.AbstractContextManager, run: Callable[[], object], layer: int):
    """Around a prefill forward: ``hook`` (the layer-wise send's ``LayerSignal``, or nothing) as the
    forward's per-layer callback, then, once the forward returned, ``run`` (the MTP's prompt rows)
    and the MTP's ``layer`` marked done on it, so a layer-wise send writes that layer last. A
    forward that raised runs no MTP, and its signal ends short of the layer (its rooms fail)."""
    with hook as after_layer:
        yield after_layer
        run()
        if after_layer is not None:
            after_layer(layer)
