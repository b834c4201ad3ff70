"""The metric names a PromQL expression reads, and the names a /metrics text exports (for the
Grafana dashboard's tests: ``tests/metrics/test_dashboard.py``, ``tests/pd/test_pd_observability.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pdserve.json"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# What the dashboard's "Data-parallel attention and experts" row reads that a server exports only
# with an MoE model: the all-to-all counters (any MoE model), the expert load imbalance (while the
# expert distribution is recorded) and EPLB's families (with --enable-eplb). The stands that check
# every dashboard metric is exported run the dense default model, so ``dashboard_exprs`` leaves
# the expressions reading them out unless asked; tests/metrics/test_dashboard.py checks an MoE
# rank exports them.
MOE_ONLY_METRICS = frozenset({
    "pdserve_moe_a2a_bytes_total", "pdserve_moe_a2a_seconds_total", "pdserve_expert_load_imbalance",
    "pdserve_eplb_rebalances_total", "pdserve_eplb_moved_experts_total", "pdserve_eplb_expert_load_imbalance",
    "pdserve_eplb_rank_load_imbalance"})


def dashboard_exprs(path: Path = DASHBOARD, include_moe_only: bool = False) -> list[str]:
    """Every target's ``expr`` in a Grafana dashboard (rows' nested panels too), but those reading
    a ``MOE_ONLY_METRICS`` name unless ``include_moe_only``: what a server of a dense model must export."""
    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    exprs = [t["expr"] for p in panels(json.loads(path.read_text())["panels"]) for t in p.get("targets", [])]
    return exprs if include_moe_only else [e for e in exprs if not metric_names(e) & MOE_ONLY_METRICS]


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: identifiers that are not functions, aggregation keywords,
    label names (inside ``{}`` or ``by (...)``), durations or Grafana variables."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\w+", " ", text)  # Grafana variables
    names = set()
    for m in _IDENT.finditer(text):
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or m.group().lower() in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        if text[m.start() - 1 : m.start()].isdigit() or text[m.start() - 1 : m.start()] == ".":
            continue  # part of a number (1e9)
        names.add(m.group())
    return names


def exported_names(metrics_text: str) -> set[str]:
    """Every name a scraper can query in a /metrics text: the families (``# TYPE``, with a
    histogram's series names) and the samples."""
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            if kind == "histogram":
                names.update(name + s for s in HISTOGRAM_SUFFIXES)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names
