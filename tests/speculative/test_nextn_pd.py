"""NEXTN through PD: the prefill hands the prompt's last hidden state to the decode's MTP with the
first token (``engine/speculative/nextn_handoff.py``) and the MTP layer's KV of the prompt in one
pool layer more (``nextn_prompt.py``), fp32, on a test-made DeepSeek-V3 whose MTP layer copies its
one layer (``support.deepseek_util``).

The real ``PrefillLoop`` and ``DecodeLoop`` with their real KV managers, models and transfer
engines (Mooncake TCP and NIXL on loopback, chunk-level and layer-wise; ``support.loop_stand.PDPair``):

- greedy output equals a colocated loop's without speculation, token for token;
- the decode's MTP drafts from its first step, from the prompt's full MTP KV: per request, as many
  drafts proposed and accepted as a colocated NEXTN loop's on the same prompts;
- both pools, the aux slots and the MTP's own pool are unleaked after every step and at the end;
- a prefill not started with NEXTN has one pool layer less: the decode's pool is refused at
  registration naming both layer counts, its request ends with that error, and everything is freed.
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
from pdserve.engine.speculative.nextn_handoff import last_prompt_rows, mtp_kv_layers
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


def colocated_nextn(path: str, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], int, int, int]]:
    """The prompts one at a time through a colocated NEXTN loop (drafts always asked, as on the
    decode below): per request its tokens, verify steps, drafts proposed and drafts accepted."""
    cfg = EngineConfig(page_size=4, **_model(path), **NEXTN)
    loop = SchedulerLoop(cfg, runner=ModelRunner(EngineConfig(page_size=4, **_model(path))))
    loop.spec.draft_cost = 0.0
    loop.spec.rule = AdaptiveRule(K)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0)
    got: dict[str, tuple[list[int], int, int, int]] = {}
    for rid, p in prompts.items():
        loop.add_request(TokenizedGenerateReq(rid, p, params, stream=True))
        tokens = []
        while loop.has_work():
            for o in loop.step():
                tokens.extend(o.new_token_ids)
                if o.finished:
                    got[rid] = (tokens, o.spec_verify_ct, o.spec_draft_token_num, o.spec_accept_token_num)
    loop.close()
    return got


def nextn_pair(path: str, backend: str, prefill_nextn: bool = True, layerwise: bool = False) -> PDPair:
    """A prefill (NEXTN or plain) and a NEXTN decode over ``backend``; drafts always asked (the tiny
    MTP's step is Python overhead, so its measured price would pause them, as in test_nextn.py).
    ``layerwise``: the KV leaves layer by layer (the MTP's last), the aux data (and the hidden
    state) in a last chunk. Each side's pool holds the MTP layer when that side runs NEXTN, as its
    loop builder makes it."""
    def runner(nextn: bool) -> ModelRunner:
        return ModelRunner(EngineConfig(page_size=4, **_model(path)),
                           extra_kv_layers=mtp_kv_layers("NEXTN" if nextn else None))

    # 8-token chunks: the longer prompts take two, and the hidden state is the last chunk's last row
    p_engine = {**_model(path), "chunked_prefill_size": 8, **(NEXTN if prefill_nextn else {})}
    pair = PDPair(p_engine=p_engine, d_engine={**_model(path), **NEXTN},
                  p_runner=runner(prefill_nextn), d_runner=runner(True),
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
def test_nextn_through_pd_equals_colocated_and_accepts_as_colocated(copy_mtp, backend, layerwise):
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts([9, 14, 5], seed=11))}
    want, want_hidden = colocated(copy_mtp, prompts)
    want_spec = colocated_nextn(copy_mtp, prompts)
    pair = nextn_pair(copy_mtp, backend, layerwise=layerwise)
    handed: dict[str, tuple[int, torch.Tensor, int]] = {}
    observe_handed = pair.decode.spec.observe_handed

    def record(req, start, hidden, prompt_kv):
        handed[req.rid] = (start, hidden.clone(), prompt_kv.count)
        observe_handed(req, start, hidden, prompt_kv)

    pair.decode.spec.observe_handed = record
    mtp_layer = pair.decode.runner.arch.num_layers
    assert pair.decode.pool.num_layers == pair.prefill.pool.num_layers == mtp_layer + 1
    try:
        assert pair.prefill.hidden is not None and pair.prefill.spec is None  # hands over, never speculates
        for rid, p in prompts.items():  # one at a time, as the colocated NEXTN reference ran them
            pair.submit(rid, p, max_new=NEW, stream=True)
            run_checked(pair, [rid])
        for rid in prompts:
            outs = pair.outputs[f"D:{rid}"]
            assert outs[-1].finish_reason != "error", outs[-1].error
            assert pair.tokens(rid) == want[rid] == want_spec[rid][0], rid
            # the first token came from the prefill, and the decode's first step already verified
            # drafts: the hidden state came with it (without it the MTP would start a step later)
            assert outs[0].new_token_ids == want[rid][:1] and outs[1].spec_verify_ct == 1, outs[:2]
            # the state handed over is the colocated target's at the last prompt position, with the
            # MTP's KV of every position before it
            start, hidden, count = handed[rid]
            assert start == count == len(prompts[rid]) - 1 and hidden.shape == (1, want_hidden[rid].numel())
            torch.testing.assert_close(hidden[0], want_hidden[rid], rtol=1e-4, atol=1e-5)
            # drafting from the prompt's full MTP KV, the decode drafts and accepts as colocated
            final = outs[-1]
            got = (final.spec_verify_ct, final.spec_draft_token_num, final.spec_accept_token_num)
            assert got == want_spec[rid][1:], (rid, got, want_spec[rid][1:])
        stats = pair.decode.spec.stats
        print(f"{backend}: {stats.accepted} of {stats.proposed} drafts accepted in {stats.verify_steps} verify steps")
        assert stats.proposed > 0 and stats.accepted > 0.6 * stats.proposed
        # the prompts' MTP rows left the prefill in the pool's last layer (nothing else writes it)
        assert bool(pair.prefill.pool.k[mtp_layer].any()) and bool(pair.decode.pool.k[mtp_layer].any())
    finally:
        pair.close()


def test_a_prefill_without_nextn_is_refused_naming_both_layer_counts(copy_mtp):
    prompts = {"r0": random_prompts([7], seed=3)[0]}
    pair = nextn_pair(copy_mtp, "mooncake", prefill_nextn=False)
    try:
        assert pair.prefill.hidden is None and pair.prefill.prompt_mtp is None
        pair.submit("r0", prompts["r0"], max_new=NEW)
        run_checked(pair, ["r0"])
        final = pair.final("D", "r0")
        assert final.finish_reason == "error"
        assert "layer count mismatch: prefill 1 layers, decode 2" in final.error, final.error
        assert "--speculative-algorithm NEXTN" in final.error
        assert pair.tokens("r0") == []
        assert pair.decode.spec.stats.proposed == 0
    finally:
        pair.close()


def test_a_prompt_partly_in_the_decodes_cache_drafts_from_the_hidden_state(copy_mtp):
    """Pages the decode's prefix cache stood in for were not sent, so their MTP rows are unknown:
    that request's MTP starts from the handed-over hidden state alone; output unchanged."""
    first = random_prompts([14], seed=5)[0]
    prompts = {"a": first, "b": first[:12] + random_prompts([5], seed=6)[0]}
    want, _ = colocated(copy_mtp, prompts)
    pair = nextn_pair(copy_mtp, "mooncake")
    handed: dict[str, tuple[int, object, int]] = {}
    observe_handed = pair.decode.spec.observe_handed

    def record(req, start, hidden, prompt_kv):
        handed[req.rid] = (start, prompt_kv, req.num_cache_pages)
        observe_handed(req, start, hidden, prompt_kv)

    pair.decode.spec.observe_handed = record
    try:
        pair.submit("a", prompts["a"], max_new=NEW, stream=True)
        pair.run(pair.done("a", sides="PD"), timeout=300)  # its pages stay in both caches (no settle)
        pair.submit("b", prompts["b"], max_new=NEW, stream=True)
        run_checked(pair, ["a", "b"])
        for rid in prompts:
            assert pair.final("D", rid).finish_reason != "error", pair.final("D", rid).error
            assert pair.tokens(rid) == want[rid], rid
        start, prompt_kv, cached = handed["a"]
        assert cached == 0 and prompt_kv is not None and prompt_kv.count == start == 13
        start, prompt_kv, cached = handed["b"]
        assert cached == 3 and prompt_kv is None and start == 16  # 12 tokens from the decode's cache
        assert pair.outputs["D:b"][1].spec_verify_ct == 1  # it still drafts from its first step
    finally:
        pair.close()
