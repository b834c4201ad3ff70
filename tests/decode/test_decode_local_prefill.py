"""Conditional disaggregation, decode side: a short prompt without bootstrap fields is prefilled
by the decode loop itself, next to requests whose KV comes from the prefill loop; a longer one is
refused. Both pools are checked after every step (``PDPair.step``)."""

from __future__ import annotations

import pytest
from support.loop_stand import PDPair, reference

from pdserve.engine.messages import TokenizedGenerateReq
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)
LIMIT = 8


@pytest.fixture
def pair():
    p = PDPair(d_max_local_prefill_tokens=LIMIT)
    yield p
    p.close()


def submit_local(pair: PDPair, rid: str, prompt: list[int], max_new: int) -> None:
    pair.decode.add_request(TokenizedGenerateReq(
        rid, list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0), bootstrap=None))


def test_short_prompts_are_prefilled_by_the_decode_loop_beside_remote_ones(pair):
    local = {f"l{i}": [i + 3] * (LIMIT - i) for i in range(3)}  # up to the limit, page-crossing
    remote = {"r0": [9] * 13, "r1": [11] * 5}
    for rid, prompt in remote.items():
        pair.submit(rid, prompt, max_new=6)
    for rid, prompt in local.items():
        submit_local(pair, rid, prompt, 6)
    pair.run(pair.done(*local, *remote, sides="D"))
    for rid, prompt in {**local, **remote}.items():
        assert pair.tokens(rid) == reference(prompt, 6), rid
    assert all(pair.final("P", rid) is None for rid in local), "local prefills never reach the prefill loop"
    assert pair.final("P", "r0") is not None and pair.final("P", "r1") is not None
    pair.settle()


def test_a_prompt_over_the_limit_is_refused(pair):
    submit_local(pair, "long", [5] * (LIMIT + 1), 4)
    pair.run(pair.done("long", sides="D"))
    out = pair.final("D", "long")
    assert out.finish_reason == "error" and "at most 8 prompt tokens" in out.error
    pair.settle()


def test_without_the_flag_every_prompt_needs_bootstrap_fields():
    p = PDPair()
    try:
        submit_local(p, "short", [5, 6], 4)
        p.run(p.done("short", sides="D"))
        assert "needs bootstrap_host" in p.final("D", "short").error
    finally:
        p.close()


def test_local_prefills_ride_in_the_running_batch_within_the_limit_per_step(pair):
    from pdserve.decode.decode_loop import local_prefill_config
    from pdserve.engine.config import EngineConfig

    c = pair.decode.scheduler.config
    assert c.enable_mixed_chunk and c.chunked_prefill_size == LIMIT
    base = EngineConfig(chunked_prefill_size=4096)
    assert local_prefill_config(base, 0) is base  # no local prefill: the decode rank as before
    assert local_prefill_config(base, 8192).chunked_prefill_size == 4096  # never above the engine's
    # a decode running while a local prefill joins: both advance in the same steps
    batches = []
    run_batch = pair.decode.run_batch

    def recording(batch):  # the real forward; the batch is kept to be looked at
        batches.append([(r.rid, n) for r, n in zip(batch.reqs, batch.extend_lens)])
        return run_batch(batch)

    pair.decode.run_batch = recording
    pair.submit("r", [9] * 13, max_new=12)
    pair.run(lambda: pair.decode.scheduler.running)
    submit_local(pair, "l", [4] * LIMIT, 6)
    pair.run(pair.done("r", "l", sides="D"))
    with_l = [b for b in batches if any(rid == "l" and n > 1 for rid, n in b)]
    assert with_l and all(sum(n for _, n in b) <= LIMIT and ("r", 1) in b for b in with_l), batches
    assert pair.tokens("r") == reference([9] * 13, 12) and pair.tokens("l") == reference([4] * LIMIT, 6)
