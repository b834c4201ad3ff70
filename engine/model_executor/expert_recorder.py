"""Per-layer, per-expert token counts of a MoE model's routed experts, recorded on request
(SGLang's ``/start_expert_distribution_record``, ``/stop_...``, ``/dump_...``; its ``stat`` mode).

While recording, each ``FusedMoE`` layer adds the (token, slot) pairs routed to the experts this
rank holds to its row of one ``[num_layers, num_experts]`` int64 tensor on the device (a gather and
a scatter-add: no host sync per step). Under expert parallelism every EP rank counts its own
experts, and ranks that only split an expert's rows (``moe_tp_rank`` > 0) count nothing, so the
sum over the group's ranks is tokens x top_k per MoE layer: ``dump`` sums the group's counts with
one all-reduce, which every TP rank runs at the same point (control operations follow TP rank 0's
broadcast). Off, a layer's only cost is one ``is None`` test.

A layer without routed experts (DeepSeek's first dense layers) keeps a row of zeros, as SGLang's
``logical_count`` does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pdserve.engine.messages import MetricFamily, MetricSample
from pdserve.engine.model_executor.layers.moe import FusedMoE
from pdserve.engine.model_executor.parallel import all_reduce, tp_size


def moe_layers(model) -> dict[int, FusedMoE]:
    """The model's routed-expert layers by decoder layer index (``model.model.layers[i].mlp.experts``)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    found = {}
    for i, layer in enumerate(layers):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if isinstance(experts, FusedMoE):
            found[i] = experts
    return found


class ExpertRecorder:
    """One rank's expert counts; ``attach`` binds a model's layers (again after a weight reload)."""

    def __init__(self, model, num_layers: int, device: torch.device):
        self.num_layers = num_layers
        self.device = device
        self.recording = False
        self.layers: dict[int, FusedMoE] = {}
        self.num_experts = 0
        self.top_k = 0
        self.counts = torch.zeros(0, dtype=torch.int64)
        self.attach(model)

    @property
    def has_experts(self) -> bool:
        return bool(self.layers)

    def attach(self, model) -> None:
        """Bind ``model``'s MoE layers (a new model after a weight update keeps the counts)."""
        self.layers = moe_layers(model) if model is not None else {}
        if self.layers:
            first = next(iter(self.layers.values()))
            if first.num_experts != self.num_experts:
                self.num_experts, self.top_k = first.num_experts, first.top_k
                self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64, device=self.device)
        self._bind()

    def _bind(self) -> None:
        for i, layer in self.layers.items():
            layer.record = self.counts[i] if self.recording else None

    def start(self) -> None:
        """Zero the counts and count from the next step on (SGLang resets on start too)."""
        if not self.has_experts:
            raise ValueError("the model has no routed experts to record")
        self.counts.zero_()
        self.recording = True
        self._bind()

    def stop(self) -> None:
        self.recording = False
        self._bind()

    def dump(self) -> torch.Tensor:
        """The group's counts, [num_layers, num_experts] int64 on the host, summed over the TP
        group's ranks; the counts are reset, as SGLang's dump does. Every TP rank must call it."""
        total = self.counts.clone()
        if tp_size() > 1:
            total = all_reduce(total)
        self.counts.zero_()
        return total.cpu()

    def families(self) -> list[MetricFamily]:
        """While recording: each MoE layer's largest and mean per-expert count over this rank's
        experts' share (``pdserve_expert_load_max_tokens`` and ``pdserve_expert_load_mean_tokens``,
        the mean over all the layer's experts), from which the front end derives the layer's
        imbalance across ranks. Read at the stats interval, not per step."""
        if not self.recording or not self.layers:
            return []
        counts = self.counts.cpu()
        held = [i for i, layer in self.layers.items() if layer.counts_tokens]
        if not held:
            return []
        mx, mean = [], []
        for i in held:
            row = counts[i]
            mx.append(MetricSample("pdserve_expert_load_max_tokens", {"layer": str(i)}, float(row.max())))
            mean.append(MetricSample("pdserve_expert_load_mean_tokens", {"layer": str(i)},
                                     float(row.sum()) / self.num_experts))
        return [
            MetricFamily("pdserve_expert_load_max_tokens", "gauge",
                         "Largest token count of one expert this rank holds, per MoE layer, while recording.", mx),
            MetricFamily("pdserve_expert_load_mean_tokens", "gauge",
                         "This rank's share of the per-expert mean token count, per MoE layer, while recording.",
                         mean),
        ]


def a2a_families(layers: Iterable[FusedMoE]) -> list[MetricFamily]:
    """The MoE ``layers``' all-to-all exchange counters of this rank, summed over layers (0 where the
    backend moves nothing: ``none`` and EP 1)."""
    sent = seconds = calls = 0.0
    for layer in layers:
        stats = getattr(layer.exchange, "stats", None)
        if stats is not None:
            sent += stats.bytes_sent
            seconds += stats.seconds
            calls += stats.calls

    def counter(name: str, doc: str, value: float) -> MetricFamily:
        return MetricFamily(name, "counter", doc, [MetricSample(name + "_total", {}, float(value))])

    return [
        counter("pdserve_moe_a2a_bytes", "Bytes this rank sent through the MoE all-to-all.", sent),
        counter("pdserve_moe_a2a_seconds", "Seconds this rank spent in the MoE all-to-all (experts excluded).",
                seconds),
        counter("pdserve_moe_a2a_calls", "MoE all-to-all exchanges this rank ran.", calls),
    ]
