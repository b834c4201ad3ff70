"""NEXTN through PD: the prefill hands the prompt's last hidden state to the decode's MTP with the
first token (``engine/speculative/nextn_handoff.py``), fp32, on a test-made DeepSeek-V3 whose MTP
layer copies its one layer (``support.deepseek_util``).

The real ``PrefillLoop`` and ``DecodeLoop`` with their real KV managers, models and transfer
engines (Mooncake TCP and NIXL on loopback, chunk-level and layer-wise; ``support.loop_stand.PDPair``):

- greedy output equals a colocated loop's without speculation, token for token;
- the decode's MTP drafts from its first step and its drafts are accepted;
- both pools, the aux slots and the MTP's own pool are unleaked after every step and at the end;
- a prefill not started with NEXTN sends no hidden state: the decode ends the request with an
  error naming the flag, and frees everything.
"""

from __future__ import annotations

import pytest
import torch
from support.deepseek_util import add_mtp_layer, make_deepseek_checkpoint
from support.loop_stand import PDPair
from support.model_util import random_prompts

from pdserve.engine.config import EngineConfig
from pdserve.engine.messages import TokenizedGenerateReq
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.scheduler_loop import SchedulerLoop
from pdserve.engine.speculative.adaptive import AdaptiveRule
from pdserve.engine.speculative.nextn_handoff import NO_HIDDEN_STATE, last_prompt_rows
from pdserve.kvtransfer.engines.transfer_engine import create_transfer_engine

pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)
K = 3
NEW = 12
NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_draft_tokens=K)


@pytest.fixture(scope="module")
def copy_mtp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deepseek_v3_mtp_copy_pd"))
    make_deepseek_checkpoint("v3", path, num_hidden_layers=1, first_k_dense_replace=2)
    add_mtp_layer(path, copy_last=True)
    return path


def _model(path: str) -> dict:
    return dict(model_path=path, dtype="float32", max_total_tokens=512)


def colocated(path: str, prompts: dict[str, list[int]]) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """The prompts through a colocated loop without speculation (the reference): their tokens, and
    the target's hidden state at each prompt's last position (the first row each request samples)."""
    loop = SchedulerLoop(EngineConfig(page_size=4, **_model(path)))
    loop.runner.model.keep_hidden = True
    last: dict[str, bytes] = {}
    run_batch = loop.run_batch

    def capture(batch):
        sampled = run_batch(batch)
        for rid, raw in last_prompt_rows(batch.reqs, batch.extend_lens, batch.sample,
                                         loop.runner.model.last_hidden).items():
            last.setdefault(rid, raw)
        return sampled

    loop.run_batch = capture
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    for rid, p in prompts.items():
        loop.add_request(TokenizedGenerateReq(rid, p, params))
    got: dict[str, list[int]] = {}
    while loop.has_work():
        for o in loop.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
    loop.close()
    return got, {rid: torch.frombuffer(bytearray(raw), dtype=torch.float32) for rid, raw in last.items()}


def nextn_pair(path: str, backend: str, prefill_nextn: bool = True, layerwise: bool = False) -> PDPair:
    """A prefill (NEXTN or plain) and a NEXTN decode over ``backend``; drafts always asked (the tiny
    MTP's step is Python overhead, so its measured price would pause them, as in test_nextn.py).
    ``layerwise``: the KV leaves layer by layer, the aux data (and the hidden state) in a last chunk."""
    runner = lambda: ModelRunner(EngineConfig(page_size=4, **_model(path)))  # noqa: E731
    # 8-token chunks: the longer prompts take two, and the hidden state is the last chunk's last row
    p_engine = {**_model(path), "chunked_prefill_size": 8, **(NEXTN if prefill_nextn else {})}
    pair = PDPair(p_engine=p_engine, d_engine={**_model(path), **NEXTN},
                  p_runner=runner(), d_runner=runner(),
                  p_transfer_engine=create_transfer_engine(backend, "127.0.0.1"),
                  d_transfer_engine=create_transfer_engine(backend, "127.0.0.1"), layerwise=layerwise)
    pair.decode.spec.draft_cost = 0.0
    pair.decode.spec.rule = AdaptiveRule(K)
    return pair


def run_checked(pair: PDPair, rids: list[str]) -> None:
    """Step both loops until every request ended, the MTP's pool checked after every step."""
    proposer = pair.decode.spec.proposer
    done = pair.done(*rids, sides="D")

    def until() -> bool:
        proposer.check_integrity()
        return done()

    pair.run(until, timeout=300)
    pair.settle()
    assert proposer.num_requests == 0 and proposer.pool.num_used == 0


@pytest.mark.parametrize("backend,layerwise", [("mooncake", False), ("nixl", False), ("mooncake", True)],
                         ids=["mooncake", "nixl", "mooncake-layerwise"])
def test_nextn_through_pd_equals_colocated_and_accepts_drafts(copy_mtp, backend, layerwise):
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([9, 14, 5], seed=11))}
    want, want_hidden = colocated(copy_mtp, prompts)
    pair = nextn_pair(copy_mtp, backend, layerwise=layerwise)
    handed: dict[str, tuple[int, torch.Tensor]] = {}
    observe_handed = pair.decode.spec.observe_handed

    def record(req, start, hidden):
        handed[req.rid] = (start, hidden.clone())
        observe_handed(req, start, hidden)

    pair.decode.spec.observe_handed = record
    try:
        assert pair.prefill.hidden is not None and pair.prefill.spec is None  # hands over, never speculates
        for rid, p in prompts.items():
            pair.submit(rid, p, max_new=NEW, stream=True)
        run_checked(pair, list(prompts))
        for rid in prompts:
            outs = pair.outputs[f"D:{rid}"]
            assert outs[-1].finish_reason != "error", outs[-1].error
            assert pair.tokens(rid) == want[rid], rid
            # the first token came from the prefill, and the decode's first step already verified
            # drafts: the hidden state came with it (without it the MTP would start a step later)
            assert outs[0].new_token_ids == want[rid][:1] and outs[1].spec_verify_ct == 1, outs[:2]
            # the state handed over is the colocated target's at the last prompt position
            start, hidden = handed[rid]
            assert start == len(prompts[rid]) - 1 and hidden.shape == (1, want_hidden[rid].numel())
            torch.testing.assert_close(hidden[0], want_hidden[rid], rtol=1e-4, atol=1e-5)
        stats = pair.decode.spec.stats
        print(f"{backend}: {stats.accepted} of {stats.proposed} drafts accepted in {stats.verify_steps} verify steps")
        assert stats.proposed > 0 and stats.accepted > 0
    finally:
        pair.close()


def test_a_prefill_without_nextn_fails_the_request_naming_the_flag(copy_mtp):
    prompts = {"r0": random_prompts([7], seed=3)[0]}
    pair = nextn_pair(copy_mtp, "mooncake", prefill_nextn=False)
    try:
        assert pair.prefill.hidden is None
        pair.submit("r0", prompts["r0"], max_new=NEW)
        run_checked(pair, ["r0"])
        final = pair.final("D", "r0")
        assert final.finish_reason == "error"
        assert NO_HIDDEN_STATE in final.error and "--speculative-algorithm NEXTN" in NO_HIDDEN_STATE
        assert pair.tokens("r0") == []
        assert pair.decode.spec.stats.proposed == 0
    finally:
        pair.close()
