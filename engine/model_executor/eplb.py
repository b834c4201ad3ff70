"""EPLB at run time (``--enable-eplb``): every ``--eplb-rebalance-num-iterations`` steps, a new
placement of each MoE layer's experts from the load counted since the last one, and the weights
moved to the ranks that now hold them.

Each ``FusedMoE`` adds the (token, slot) pairs routed to the replicas this rank holds to its row
of ``load`` (as the expert recorder counts, independently of it: the recorder keeps its own
counts, by logical expert, across a rebalance). The ranks' rows sum to tokens x top_k per layer:
a rank that sees every row counts the slots it holds (one rank per EP rank counts), and under DP
attention's all-to-all each rank counts every slot of its own share of its group's rows (the ranks
of a group split its rows, so none is counted twice). At the step boundary every rank runs the same
``step`` in lockstep (identical scheduling on every TP rank; under DP attention a step is a forward
round, which every rank answers with a forward or an idle one, ``ModelRunner._balance_experts``):
one all-reduce over the ranks the MoE layers span (the TP group; under DP attention the world of
every attention group) sums the load,
``ep_rebalance.rebalance_layer`` (pure, so identical on every rank) gives the new placement, and
an expert a rank now holds and did not hold before comes from a rank that held it, by gloo
point-to-point (each (expert, destination) a tagged send and receive, all posted before any
wait); the rank with the same ``moe_tp_rank`` sends, so a split expert's rows move as slices.
No request is dropped: the step that follows runs on the new placement.

``families`` exports what the balancer did on ``/metrics``: its rebalances and the expert copies
moved (counters), and per MoE layer the load it balanced at the last rebalance: the largest
expert's count over the mean (how skewed the experts are) and the busiest EP rank's over the mean
under the placement it chose (what is left of the skew after balancing). Every TP rank computes
them from the same all-reduced counts.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from pdserve.engine.messages import MetricFamily, MetricSample
from pdserve.engine.model_executor.layers.ep_placement import ExpertPlacement
from pdserve.engine.model_executor.layers.ep_rebalance import rank_imbalance, rebalance_layer
from pdserve.engine.model_executor.layers.moe import FusedMoE
from pdserve.engine.model_executor.parallel import all_reduce_world

logger = logging.getLogger(__name__)


class ExpertBalancer:
    """Counts the steps and rebalances the ``layers`` (by decoder layer index) every ``every`` of them."""

    def __init__(self, layers: dict[int, FusedMoE], num_layers: int, every: int, device: torch.device):
        if any(layer.plan.quantized for layer in layers.values()):
            raise ValueError("enable_eplb needs unquantized expert weights (it moves them as loaded)")
        self.layers, self.every = layers, every
        self.steps = self.rebalances = self.moved = 0
        # per layer at the last rebalance: max / mean of the experts' counts, and of the EP ranks'
        self.expert_imbalance: dict[int, float] = {}
        self.rank_imbalance: dict[int, float] = {}
        num_experts = next(iter(layers.values())).num_experts if layers else 0
        self.load = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        for i, layer in layers.items():
            layer.load = self.load[i]

    def step(self) -> None:
        """Before each forward step: rebalance when ``every`` steps ran since the last one."""
        if self.steps and self.steps % self.every == 0:
            self.rebalance()
        self.steps += 1

    def rebalance(self) -> None:
        """New placements from the load of every rank the MoE layers span; each calls it at the same step."""
        total = all_reduce_world(self.load.clone()).tolist()
        moved = 0
        for i, layer in self.layers.items():
            new = rebalance_layer(total[i], layer.placement)
            if new != layer.placement:
                before = rank_imbalance(layer.placement, total[i])
                moved += move_experts(layer, new)
                logger.debug("EPLB layer %d: rank imbalance %.3f -> %.3f", i, before, rank_imbalance(new, total[i]))
            self.expert_imbalance[i] = expert_imbalance(total[i])
            self.rank_imbalance[i] = rank_imbalance(layer.placement, total[i])
        self.load.zero_()
        self.rebalances += 1
        self.moved += moved
        logger.info("EPLB rebalance %d at step %d: %d expert copies moved between ranks", self.rebalances,
                    self.steps, moved)


    def families(self) -> list[MetricFamily]:
        """``pdserve_eplb_rebalances_total``, ``pdserve_eplb_moved_experts_total`` and, once a
        rebalance ran, ``pdserve_eplb_expert_load_imbalance`` and ``pdserve_eplb_rank_load_imbalance``
        per MoE layer (1.0: even)."""
        def counter(name: str, doc: str, value: int) -> MetricFamily:
            return MetricFamily(name, "counter", doc, [MetricSample(name + "_total", {}, float(value))])

        def per_layer(name: str, doc: str, values: dict[int, float]) -> MetricFamily:
            return MetricFamily(name, "gauge", doc, [MetricSample(name, {"layer": str(i)}, round(v, 6))
                                                     for i, v in sorted(values.items())])

        out = [counter("pdserve_eplb_rebalances", "EPLB rebalances run.", self.rebalances),
               counter("pdserve_eplb_moved_experts", "Expert copies EPLB moved between ranks.", self.moved)]
        if self.expert_imbalance:
            out += [per_layer("pdserve_eplb_expert_load_imbalance",
                              "Largest expert token count over the mean, per MoE layer, at the last rebalance.",
                              self.expert_imbalance),
                    per_layer("pdserve_eplb_rank_load_imbalance",
                              "Busiest EP rank's token count over the mean under the placement chosen, per MoE "
                              "layer, at the last rebalance.", self.rank_imbalance)]
        return out


def expert_imbalance(load: list[int]) -> float:
    """max / mean of the experts' token counts (1.0: even, or no load)."""
    mean = sum(load) / len(load) if load else 0.0
    return max(load) / mean if mean > 0 else 1.0


def transfers(old: ExpertPlacement, new: ExpertPlacement) -> list[tuple[int, int, int]]:
    """(destination EP rank, logical expert, source EP rank) for each expert a rank holds under
    ``new`` and not under ``old``, in one order every rank computes alike; the source is the
    lowest rank that held it."""
    out = []
    for r in range(new.ep_size):
        have = set(old.experts_of(r))
        for e in sorted(set(new.experts_of(r)) - have):
            out.append((r, e, min(old.owner[p] for p in old.replicas()[e])))
    return out


def move_experts(layer: FusedMoE, new: ExpertPlacement) -> int:
    """Give ``layer`` placement ``new`` with its weights; returns the expert copies the group moved."""
    ep, me = layer.ep, layer.ep_rank
    plan = transfers(layer.placement, new)

    def peer(ep_rank: int) -> int:  # the TP rank of that EP rank holding this rank's rows
        return ep_rank * ep.moe_tp_size + ep.moe_tp_rank

    pending, received = [], {}
    for k, (dst, e, src) in enumerate(plan):
        if src == me:
            w13, w2 = layer.local_weights(layer.slots_of[e][0])
            pending += [(dist.isend(w13, peer(dst), tag=2 * k), w13), (dist.isend(w2, peer(dst), tag=2 * k + 1), w2)]
        if dst == me:
            w13 = torch.empty(2 * layer.inter, layer.hidden, dtype=layer.plan.dtype, device=layer.plan.device)
            w2 = torch.empty(layer.hidden, layer.inter, dtype=layer.plan.dtype, device=layer.plan.device)
            pending += [(dist.irecv(w13, peer(src), tag=2 * k), w13), (dist.irecv(w2, peer(src), tag=2 * k + 1), w2)]
            received[e] = (w13, w2)
    for work, _ in pending:
        work.wait()
    slots = []
    for e in new.experts_of(me):
        slots.append(layer.local_weights(layer.slots_of[e][0]) if layer.slots_of[e] else received[e])
    layer.install(new, torch.stack([a for a, _ in slots]), torch.stack([b for _, b in slots]))
    return len(plan)
