"""Expert distribution recording (SGLang's start / stop / dump) on the tiny random Qwen3-MoE
(3 layers, 8 experts, top 3) in one in-process Engine: per MoE layer the counts sum to the tokens
the model ran x top_k, nothing is counted before start or after stop, a dump starts the counts
again from zero, and the rank's metric families carry the load while recording. The front end's
imbalance (max / mean per layer) is derived from the TP ranks' shares."""

from __future__ import annotations

import pytest
from support.model_util import make_tiny_checkpoint

from pdserve.engine import Engine
from pdserve.engine.frontend.expert_metrics import imbalance_family
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.messages import MetricFamily, MetricSample, RankMetrics

pytestmark = pytest.mark.timeout(300)

TOP_K, EXPERTS, LAYERS = 3, 8, 3
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_qwen3_moe"))
    make_tiny_checkpoint("qwen3_moe", path)
    return path


def ran(out: dict) -> int:
    """Tokens the model ran for one request: the uncached prompt, then each output token but the last."""
    meta = out["meta_info"]
    return meta["prompt_tokens"] - meta["cached_tokens"] + meta["completion_tokens"] - 1


def test_dump_counts_tokens_times_top_k(moe_ckpt):
    with Engine(model_path=moe_ckpt, dtype="float32", max_total_tokens=1024, num_threads=1,
                rank_on_thread=True) as engine:
        engine.generate(input_ids=[9, 8, 7, 6], sampling_params=GREEDY)  # before start: not counted
        engine.start_expert_distribution_record()
        outs = [engine.generate(input_ids=p, sampling_params=GREEDY)
                for p in ([1, 5, 9, 33, 100, 7], list(range(3, 40)))]
        families = {f.name: f for f in engine.call(lambda: engine.loop.runner.model_families())}
        engine.stop_expert_distribution_record()
        engine.generate(input_ids=[40, 41, 42], sampling_params=GREEDY)  # after stop: not counted
        counts = engine.dump_expert_distribution_record()
        again = engine.dump_expert_distribution_record()
        off = engine.call(lambda: engine.loop.runner.model_families())
    tokens = sum(ran(o) for o in outs)
    assert tokens > 40
    assert len(counts) == LAYERS and all(len(row) == EXPERTS for row in counts)
    assert [sum(row) for row in counts] == [tokens * TOP_K] * LAYERS
    assert again == [[0] * EXPERTS] * LAYERS
    # while recording: each layer's largest count and mean; the a2a counters (nothing moves at EP 1)
    peak = [s.value for s in families["pdserve_expert_load_max_tokens"].samples]
    mean = [s.value for s in families["pdserve_expert_load_mean_tokens"].samples]
    assert mean == [tokens * TOP_K / EXPERTS] * LAYERS and all(p >= m for p, m in zip(peak, mean))
    assert families["pdserve_moe_a2a_bytes"].samples[0].value == 0
    assert {f.name for f in off} == {"pdserve_moe_a2a_bytes", "pdserve_moe_a2a_seconds", "pdserve_moe_a2a_calls"}


def _shares(tp: int, peak: float, mean: float) -> RankMetrics:
    def family(name: str, value: float) -> MetricFamily:
        return MetricFamily(name, "gauge", "", [MetricSample(name, {"layer": "1"}, value)])

    return RankMetrics(0, tp, [family("pdserve_expert_load_max_tokens", peak),
                               family("pdserve_expert_load_mean_tokens", mean)])


def test_imbalance_is_the_groups_max_over_its_mean():
    assert imbalance_family("m", {}) is None
    g = imbalance_family("m", {(0, 0): _shares(0, 10.0, 3.0), (0, 1): _shares(1, 6.0, 2.0)})
    assert [(s.labels["dp_rank"], s.labels["layer"], s.value) for s in g.samples] == [("0", "1", 2.0)]
    text = ServerMetrics(1, "m").render([None], [0], {(0, 0): _shares(0, 10.0, 3.0), (0, 1): _shares(1, 6.0, 2.0)})
    assert 'pdserve_expert_load_imbalance{model_name="m",dp_rank="0",layer="1"} 2.0' in text


def _rank(dp: int, peak: float, mean: float) -> RankMetrics:
    return RankMetrics(dp, 0, _shares(0, peak, mean).families)


def test_imbalance_under_dp_attention_spans_every_dp_rank():
    """Two DP ranks of one process each, each holding half the experts: per DP rank the ratio
    would be 10/3 and 6/2; the experts span both, so each DP rank reports 10 / (3 + 2)."""
    latest = {(0, 0): _rank(0, 10.0, 3.0), (1, 0): _rank(1, 6.0, 2.0)}
    per_dp = imbalance_family("m", latest)
    assert [(s.labels["dp_rank"], s.value) for s in per_dp.samples] == [("0", round(10 / 3, 6)), ("1", 3.0)]
    spanning = imbalance_family("m", latest, experts_span_dp=True)
    assert [(s.labels["dp_rank"], s.labels["layer"], s.value) for s in spanning.samples] == [
        ("0", "1", 2.0), ("1", "1", 2.0)]
    text = ServerMetrics(2, "m", experts_span_dp=True).render([None, None], [0, 0], latest)
    assert 'pdserve_expert_load_imbalance{model_name="m",dp_rank="1",layer="1"} 2.0' in text
