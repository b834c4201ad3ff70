"""The Prometheus text format of a ``CollectorRegistry``, each sample's labels in their declared order.

``prometheus_client.generate_latest`` sorts label names (every release, 0.17 to 0.26
checked). The /metrics text of the engine server and of the router has always put
the labels in the order they are declared (``model_name`` before ``dp_rank``,
``worker`` before ``leg``), and its readers match lines as text (tests/server,
tests/router, scripts/soak.py). So the samples, values and registry are the
library's; only this loop over them is ours. The ``_created`` series, which the
endpoints never had, are left out.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.utils import floatToGoString


def exposition(registry: CollectorRegistry) -> bytes:
    lines = []
    for family in registry.collect():
        name = family.name + "_total" if family.type == "counter" else family.name
        help_ = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {family.type}"]
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
            value = floatToGoString(sample.value)
            lines.append(f"{sample.name}{{{labels}}} {value}" if labels else f"{sample.name} {value}")
    return ("\n".join(lines) + "\n").encode()


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r'\"').replace("\n", r"\n")
