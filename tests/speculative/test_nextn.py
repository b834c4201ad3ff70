"""NEXTN: DeepSeek's MTP layer drafts from the target's hidden states (``speculative/nextn.py``), fp32.

- a random MTP layer: greedy output through the scheduler loop equals plain decoding's;
- an MTP layer that copies a one-layer target's layer and head guesses its greedy tokens: most
  drafts are accepted (the spec metrics), and the output is plain decoding's too;
- pages of the target's pool and of the MTP's own are checked after every step and all free at the end;
- a checkpoint without MTP layers, a model that is not DeepSeek's and a draft model path are
  refused by name; PD prefill and decode servers take NEXTN (``test_nextn_pd.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.deepseek_util import add_mtp_layer, make_deepseek_checkpoint
from support.model_util import greedy_generate, make_tiny_checkpoint, random_prompts

from pdserve.engine.config import EngineConfig
from pdserve.engine.messages import TokenizedGenerateReq
from pdserve.engine.model_executor.model_runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.scheduler_loop import SchedulerLoop
from pdserve.engine.speculative.adaptive import AdaptiveRule
from pdserve.engine.speculative.registry import create_proposer

torch.set_num_threads(1)
K = 3
NEW = 12


def _config(path: str) -> EngineConfig:
    return EngineConfig(model_path=path, dtype="float32", max_total_tokens=512, page_size=4)


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deepseek_v3_mtp"))
    make_deepseek_checkpoint("v3", path)
    add_mtp_layer(path, copy_last=False)
    return path


@pytest.fixture(scope="module")
def copy_mtp(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deepseek_v3_mtp_copy"))
    make_deepseek_checkpoint("v3", path, num_hidden_layers=1, first_k_dense_replace=2)
    add_mtp_layer(path, copy_last=True)
    return path


def run_loop(path: str, prompts: list[list[int]]) -> tuple[dict[str, list[int]], SchedulerLoop]:
    """Every prompt through a NEXTN loop, drafts always asked (the tiny MTP's step is Python
    overhead, so the measured price would pause them); integrity checked after every step."""
    cfg = dataclasses.replace(_config(path), speculative_algorithm="NEXTN", speculative_num_draft_tokens=K)
    loop = SchedulerLoop(cfg, runner=ModelRunner(_config(path)))
    loop.spec.draft_cost = 0.0
    loop.spec.rule = AdaptiveRule(K)
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        loop.add_request(TokenizedGenerateReq(f"r{i}", p, params, stream=True))
    got: dict[str, list[int]] = {}
    while loop.has_work():
        for o in loop.step():
            got.setdefault(o.rid, []).extend(o.new_token_ids)
        loop.check_integrity()
        loop.spec.proposer.check_integrity()
    proposer = loop.spec.proposer
    assert proposer.num_requests == 0 and proposer.pool.num_used == 0
    assert loop.flush_cache()
    assert loop.pool.num_used == 0
    return got, loop


def plain(path: str, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_generate(ModelRunner(_config(path)), prompts, NEW)[0]


def test_random_mtp_keeps_greedy_output(random_mtp):
    prompts = random_prompts([6, 17, 2], seed=4)
    got, loop = run_loop(random_mtp, prompts)
    assert [got[f"r{i}"] for i in range(3)] == plain(random_mtp, prompts)
    assert loop.spec.stats.verify_steps > 0 and loop.spec.stats.proposed > 0
    loop.close()


def test_mtp_copying_the_last_layer_accepts_most_drafts(copy_mtp):
    prompts = random_prompts([9, 14], seed=11)
    got, loop = run_loop(copy_mtp, prompts)
    assert [got[f"r{i}"] for i in range(2)] == plain(copy_mtp, prompts)
    stats = loop.spec.stats
    assert stats.proposed > 0 and stats.accepted > 0.6 * stats.proposed
    loop.close()


def test_checkpoints_without_mtp_layers_are_refused_by_name(tmp_path):
    from pdserve.engine.server_config import ServerConfig

    ds, llama = str(tmp_path / "ds"), str(tmp_path / "llama")
    make_deepseek_checkpoint("v2", ds, num_hidden_layers=1)
    make_tiny_checkpoint("llama", llama)
    for path, match in ((ds, "num_nextn_predict_layers"), (llama, "DeepSeek-V2/V3")):
        cfg = dataclasses.replace(_config(path), speculative_algorithm="NEXTN")
        with pytest.raises(ValueError, match=match):
            create_proposer(cfg, ModelRunner(_config(path)))
    with pytest.raises(ValueError, match="NEXTN uses no draft model"):
        dataclasses.replace(_config(ds), speculative_algorithm="NEXTN", speculative_draft_model_path=llama)
    engine = dataclasses.replace(_config(ds), speculative_algorithm="NEXTN")
    for mode in ("prefill", "decode"):  # the prefill hands the hidden state over (test_nextn_pd.py)
        assert ServerConfig(engine=engine, disaggregation_mode=mode).engine.speculative_algorithm == "NEXTN"
