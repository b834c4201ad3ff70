"""The stage timelines of traced requests on one scheduler rank (``--enable-trace``).

A request the front end traces (``TokenizedGenerateReq.trace``, set only for a sampled trace)
gets a ``StageTimeline`` on admission; the loop notes each forward it takes part in, the PD
loops note their bootstrap, preallocation and KV transfer, and the timeline leaves with the
request's final ``TokenOutput``. The HTTP process makes the child spans from it
(``engine/frontend/request_trace.py``).

Free when off: an untraced request carries ``timeline = None`` and nothing is allocated for it;
the loop looks at the batch only while ``live`` (traced requests on the rank) is non-zero.
Only TP rank 0 records (the other TP ranks run the same requests in lockstep and ship nothing).

Decode steps are sampled: the first (``decode.first_step``), every ``DECODE_STEP_SAMPLE``-th and
the last are kept, so a long generation costs a bounded number of spans.
"""

from __future__ import annotations

import time

from pdserve.engine.messages import StageTimeline
from pdserve.engine.sched.request import Req
from pdserve.engine.sched.scheduler import ForwardMode, ScheduledBatch

DECODE_STEP_SAMPLE = 16  # keep decode steps 0, 16, 32, ... (and the last)


def note_step(tl: StageTimeline, start: float, end: float) -> None:
    """One decode forward of the request. The latest step always sits at the tail; an unsampled
    tail is replaced by the next step, so only the sampled ones and the last stay."""
    k = tl.num_steps
    tl.num_steps += 1
    entry = (start, end, k)
    if tl.steps and tl.steps[-1][2] % DECODE_STEP_SAMPLE:
        tl.steps[-1] = entry
    else:
        tl.steps.append(entry)


class StageRecorder:
    def __init__(self, dp_rank: int, enabled: bool):
        """``enabled``: this rank records (TP rank 0); elsewhere ``start`` does nothing."""
        self.dp_rank = dp_rank
        self.enabled = enabled
        self.live = 0  # traced requests holding a timeline on this rank

    def start(self, req: Req) -> None:
        """A traced request arrived (``enqueued``)."""
        if self.enabled:
            req.timeline = StageTimeline(enqueued=time.monotonic(), dp_rank=self.dp_rank)
            self.live += 1

    def on_forward(self, batch: ScheduledBatch, start: float, end: float) -> None:
        """A forward ran from ``start`` to ``end``: a prefill chunk or a decode step of each traced
        request in it (a mixed batch carries both). Call only while ``live``."""
        decode = batch.mode is ForwardMode.DECODE
        for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            tl = req.timeline
            if tl is None:
                continue
            if decode or (extend == 1 and prefix >= req.prompt_len):
                note_step(tl, start, end)
            else:
                tl.chunks.append((start, end, extend))

    def finish(self, req: Req) -> StageTimeline | None:
        """The request's timeline, closed, as its final output takes it (None when untraced)."""
        tl = req.timeline
        if tl is None:
            return None
        req.timeline = None
        self.live -= 1
        tl.finished = time.monotonic()
        tl.num_retractions = req.num_retractions
        tl.cached_host_tokens, tl.cached_storage_tokens = req.host_hit_tokens, req.storage_hit_tokens
        return tl
