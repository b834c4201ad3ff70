"""The per-layer expert load imbalance of ``/metrics``, derived from the ranks' expert counts.

Each rank that counts experts sends, while recording, each MoE layer's largest count among the
experts it holds and its share of the mean per-expert count (``expert_recorder.families``). A
DP rank's EP group together holds every expert once, so per DP rank and layer the imbalance is
the largest count over its TP ranks divided by the sum of their shares of the mean:
``pdserve_expert_load_imbalance`` (1.0 is a perfectly even layer; 0 tokens yet: no sample).
Under DP attention the experts are spread over every DP rank's processes and each counts the
rows of all groups, so the imbalance is taken over every rank of the server, the same for each
DP rank (the experts its tokens are routed to).
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from pdserve.engine.messages import RankMetrics

MAX_FAMILY = "pdserve_expert_load_max_tokens"
MEAN_FAMILY = "pdserve_expert_load_mean_tokens"


def imbalance_family(model_name: str, latest: dict[tuple[int, int], RankMetrics],
                     experts_span_dp: bool = False) -> GaugeMetricFamily | None:
    """``pdserve_expert_load_imbalance{dp_rank, layer}`` (max / mean), or None when no rank records;
    ``experts_span_dp``: the experts span every DP rank (DP attention): one value over all ranks."""
    peak: dict[tuple[int, str], float] = {}
    mean: dict[tuple[int, str], float] = {}
    for (dp, _tp), msg in latest.items():
        group = -1 if experts_span_dp else dp
        for f in msg.families:
            if f.name == MAX_FAMILY:
                for s in f.samples:
                    key = (group, s.labels["layer"])
                    peak[key] = max(peak.get(key, 0.0), s.value)
            elif f.name == MEAN_FAMILY:
                for s in f.samples:
                    key = (group, s.labels["layer"])
                    mean[key] = mean.get(key, 0.0) + s.value
    if not peak:
        return None
    g = GaugeMetricFamily("pdserve_expert_load_imbalance",
                          "Largest expert token count over the mean per MoE layer, while recording.",
                          labels=("model_name", "dp_rank", "layer"))
    dp_ranks = sorted({dp for dp, _tp in latest})
    for (group, layer), m in sorted(mean.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
        if m > 0:
            value = round(peak.get((group, layer), 0.0) / m, 6)
            for dp in dp_ranks if group == -1 else [group]:
                g.add_metric((model_name, str(dp), layer), value)
    return g
