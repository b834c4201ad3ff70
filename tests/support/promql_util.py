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


def dashboard_exprs(path: Path = DASHBOARD) -> list[str]:
    """Every target's ``expr`` in a Grafana dashboard (rows' nested panels too)."""
    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    return [t["expr"] for p in panels(json.loads(path.read_text())["panels"]) for t in p.get("targets", [])]


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
