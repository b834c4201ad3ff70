"""A traced request's stage timeline, recorded by real prefill and decode loops in one process
(``loop_stand``, the ``local`` transfer backend) and turned into spans by ``request_trace``:
one chunk per ``--chunked-prefill-size`` piece, the room's KV bytes on both sides, the decode's
preallocation before its transfer before its first step; none at all for an untraced request.
The multi-process stand checks the exported spans: ``tests/pd/test_trace_stages.py``."""

from __future__ import annotations

import pytest
from support.loop_stand import PS, PDPair

from pdserve.engine.frontend.request_trace import stage_spans
from pdserve.engine.messages import StageTimeline
from pdserve.engine.sched.stage_recorder import DECODE_STEP_SAMPLE, note_step

pytestmark = pytest.mark.timeout(60)

CHUNK = 8


@pytest.fixture
def pair():
    p = PDPair(p_engine={"chunked_prefill_size": CHUNK})
    yield p
    p.close()


def test_traced_request_carries_its_stages(pair):
    prompt, max_new = list(range(100, 130)), 5  # 30 tokens: chunks of 8, 8, 8, 6
    pair.submit("t", prompt, max_new=max_new, trace=True)
    pair.run(pair.done("t"))
    pair.settle()
    p, d = pair.final("P", "t").stages, pair.final("D", "t").stages
    assert p is not None and d is not None
    assert [n for _, _, n in p.chunks] == [8, 8, 8, 6]
    room_bytes = pair.prefill.kv.metrics.room_page_bytes * -(-len(prompt) // PS)
    assert p.transfer_bytes == d.transfer_bytes == room_bytes
    assert p.transfer_backend == d.transfer_backend == "local"
    assert p.enqueued <= p.bootstrapped <= p.chunks[0][0] <= p.chunks[-1][1] <= p.finished
    assert all(a[1] <= b[0] for a, b in zip(p.chunks, p.chunks[1:])), "chunks in order, not overlapping"
    assert p.transfer_start <= p.transfer_end and not p.steps
    # the decode: its first token came from the prefill; each later one is a decode step of its own
    assert d.enqueued <= d.prealloc_done <= d.transfer_start <= d.transfer_end <= d.steps[0][0] <= d.finished
    assert d.num_steps == max_new - 1 and [k for _, _, k in d.steps] == [0, max_new - 2] and not d.chunks
    names = [n for n, *_ in stage_spans(p, "prefill")]
    assert names == ["prefill.bootstrap_wait", "prefill.queue", *["prefill.chunk"] * 4, "prefill.kv_transfer"]
    names = [n for n, *_ in stage_spans(d, "decode")]
    assert names == ["decode.prealloc", "decode.kv_transfer", "decode.first_step", "decode.step"]
    kv = next(a for n, _, _, a in stage_spans(d, "decode") if n == "decode.kv_transfer")
    assert kv["pdserve.kv_bytes"] == room_bytes


def test_untraced_request_carries_no_timeline(pair):
    pair.submit("u", list(range(40)), max_new=3)
    pair.run(pair.done("u"))
    outs = pair.outputs["P:u"] + pair.outputs["D:u"]
    assert outs and all(o.stages is None for o in outs)
    assert pair.prefill.stages.live == pair.decode.stages.live == 0


def test_traced_and_untraced_side_by_side_leave_nothing_live(pair):
    pair.submit("a", list(range(20)), max_new=3, trace=True)
    pair.submit("b", list(range(50, 70)), max_new=3)
    pair.run(pair.done("a", "b"))
    assert pair.final("D", "a").stages is not None and pair.final("D", "b").stages is None
    assert pair.prefill.stages.live == pair.decode.stages.live == 0


def test_decode_steps_are_sampled_first_every_nth_and_last():
    tl = StageTimeline(enqueued=0.0)
    n = 2 * DECODE_STEP_SAMPLE + 5
    for k in range(n):
        note_step(tl, float(k), k + 0.5)
    assert tl.num_steps == n
    assert [k for _, _, k in tl.steps] == [0, DECODE_STEP_SAMPLE, 2 * DECODE_STEP_SAMPLE, n - 1]
    names = [name for name, *_ in stage_spans(tl, "null")]
    assert names == ["queue", "decode.first_step", "decode.step", "decode.step", "decode.step"]


def test_colocated_request_has_chunks_then_decode_steps():
    """A colocated rank (the same loop, no PD): the prompt's chunks, then one decode step per token
    after the first (which the last chunk's forward sampled)."""
    from support.loop_stand import EchoRunner

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.messages import TokenizedGenerateReq
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.sched.scheduler_loop import SchedulerLoop

    cfg = EngineConfig(page_size=PS, chunked_prefill_size=CHUNK)
    loop = SchedulerLoop(cfg, runner=EchoRunner(64, cfg))
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    loop.add_request(TokenizedGenerateReq("c", list(range(20)), params, trace=True))
    loop.add_request(TokenizedGenerateReq("u", list(range(30, 40)), params))
    finals = {}
    for _ in range(100):
        finals.update({o.rid: o for o in loop.step() if o.finished})
        if len(finals) == 2:
            break
    assert finals["u"].stages is None
    tl = finals["c"].stages
    assert [n for _, _, n in tl.chunks] == [8, 8, 4]
    assert tl.num_steps == 3 and [k for _, _, k in tl.steps] == [0, 2]
    assert tl.chunks[-1][1] <= tl.steps[0][0] and tl.transfer_start is None
    names = [n for n, *_ in stage_spans(tl, "null")]
    assert names == ["queue", "prefill.chunk", "prefill.chunk", "prefill.chunk", "decode.first_step", "decode.step"]
    assert loop.stages.live == 0
    loop.close()
