"""``docs/grafana/pdserve.json`` parses, and its PromQL reads metrics pdserve declares. That a
running prefill, decode and router export every one of them is checked on a real 1P1D stand:
``tests/pd/test_pd_observability.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.promql_util import DASHBOARD, dashboard_exprs, exported_names, metric_names

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
    exprs = dashboard_exprs()
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
