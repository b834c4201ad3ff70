"""``docs/grafana/pdserve.json`` parses, its panels have unique ids and do not overlap, and its
PromQL reads metrics pdserve declares. That a running prefill, decode and router export every one
of them is checked on a real 1P1D stand (``tests/pd/test_pd_observability.py``), but the ones only
a server of an MoE model exports (``MOE_ONLY_METRICS``): an MoE rank's are checked here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.model_util import make_tiny_checkpoint
from support.promql_util import DASHBOARD, MOE_ONLY_METRICS, dashboard_exprs, exported_names, metric_names

from pdserve.engine import Engine
from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.messages import RankMetrics
from pdserve.engine.model_executor.eplb import ExpertBalancer

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("expr, names", [
    ('histogram_quantile(0.99, sum by (le, leg) (rate(pdserve_router_leg_latency_seconds_bucket[$__rate_interval])))',
     {"pdserve_router_leg_latency_seconds_bucket"}),
    ('sum by (job, cause) (rate(pdserve_kv_rooms_total{state="failed", job=~"$decode_job"}[5m])) / 1e9',
     {"pdserve_kv_rooms_total"}),
    ("pdserve_a + on(dp_rank) group_left pdserve_b offset 5m", {"pdserve_a", "pdserve_b"}),
    ("max by (job) (up) and pdserve_kv_usage > 0.9", {"up", "pdserve_kv_usage"}),
])
def test_metric_names_of_an_expression(expr, names):
    assert metric_names(expr) == names


def test_exported_names_of_a_metrics_text():
    text = ("# HELP x_seconds h\n# TYPE x_seconds histogram\n# HELP y_total c\n# TYPE y_total counter\n"
            'y_total{cause="none"} 1.0\n')
    assert exported_names(text) == {"x_seconds", "x_seconds_bucket", "x_seconds_sum", "x_seconds_count", "y_total"}


def test_the_dashboard_queries_what_the_package_declares():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] == "pdserve" and dash["panels"]
    exprs = dashboard_exprs(include_moe_only=True)
    assert len(exprs) >= 16
    names = set().union(*map(metric_names, exprs))
    source = "".join(p.read_text() for folder in ("engine", "kvtransfer", "router")
                     for p in (REPO / folder).rglob("*.py"))
    for name in names:
        base = name
        for suffix in ("_bucket", "_sum", "_count", "_total"):
            base = base.removesuffix(suffix)
        # declared whole, or (the PD queue gauges) by the part after the prefix
        assert f'"{base}' in source or f'"{base.removeprefix("pdserve_")}"' in source, name


def all_panels() -> list[dict]:
    """The dashboard's panels, rows' nested ones too."""
    out = []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        out += [p, *p.get("panels", [])]
    return out


def row_panels(title: str) -> list[dict]:
    """The panels under the row ``title``, up to the next row."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title)
    row = []
    for p in panels[start + 1:]:
        if p["type"] == "row":
            break
        row.append(p)
    return row


def test_panel_ids_are_unique_and_no_two_panels_overlap():
    panels = all_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    boxes = [(p["id"], p["gridPos"]) for p in panels]
    for pid, g in boxes:
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, pid
    for i, (a, ga) in enumerate(boxes):
        for b, gb in boxes[i + 1:]:
            apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"]
                     or ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
            assert apart, (a, b)


def test_the_dp_attention_row_reads_the_per_rank_load_and_the_moe_families():
    row = row_panels("Data-parallel attention and experts")
    assert len(row) == 6
    names = set().union(*(metric_names(t["expr"]) for p in row for t in p["targets"]))
    assert names == MOE_ONLY_METRICS | {"pdserve_num_running_reqs", "pdserve_num_waiting_reqs",
                                        "pdserve_num_running_tokens", "pdserve_num_queued_tokens"}
    per_rank = [t["expr"] for p in row[:2] for t in p["targets"]]
    assert sum("by (job, dp_rank)" in e for e in per_rank) == 4, per_rank
    # what a dense server is not asked for is exactly the MoE-only set, and only this row reads it
    every = set().union(*map(metric_names, dashboard_exprs(include_moe_only=True)))
    dense = set().union(*map(metric_names, dashboard_exprs()))
    assert every - dense == MOE_ONLY_METRICS
    others = [p for p in all_panels() if p not in row]
    assert not set().union(*(metric_names(t["expr"]) for p in others for t in p.get("targets", []))) & MOE_ONLY_METRICS


def test_an_moe_rank_exports_the_moe_only_metrics(tmp_path):
    """The tiny Qwen3-MoE in one in-process rank, recording its expert distribution: its families
    (the all-to-all counters, the expert load) through the front end's /metrics, with an EPLB
    balancer's over its MoE layers (EPLB needs EP >= 2 processes to run in a server: its
    families' export from real ranks is tests/tp/test_eplb.py's)."""
    make_tiny_checkpoint("qwen3_moe", str(tmp_path))
    with Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=1024, num_threads=1,
                rank_on_thread=True) as engine:
        engine.start_expert_distribution_record()
        engine.generate(input_ids=[1, 5, 9, 33, 100, 7], sampling_params={"temperature": 0, "max_new_tokens": 4})

        def families():
            runner = engine.loop.runner
            layers = runner.expert_recorder.layers
            balancer = ExpertBalancer(layers, max(layers) + 1, 1, torch.device("cpu"))
            balancer.rebalance()  # one EP rank: the placement stays, each layer's imbalance is kept
            return runner.model_families() + balancer.families()

        text = ServerMetrics(1, "m").render([None], [0], {(0, 0): RankMetrics(0, 0, engine.call(families))})
    assert not MOE_ONLY_METRICS - exported_names(text), sorted(MOE_ONLY_METRICS - exported_names(text))
