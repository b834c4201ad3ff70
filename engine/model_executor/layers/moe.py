"""The mixture-of-experts layer's interface: ``FusedMoE`` owns E experts' gate|up and down
matrices (each sharded over the TP ranks on the intermediate dimension, as a dense MLP is) and
routes every token to its top-k experts through a ``MoEMethod`` chosen at load.

Under expert parallelism (``parallel.init_ep``: a property of the process's parallel state, the
same for every model) a rank holds whole experts instead, its share by ``ExpertPlacement``, and
an exchange (``moe_a2a.py``) brings each token to the ranks holding its experts. The method
then holds this rank's experts only, addressed by local index.

``PerExpertMoEMethod`` is the reference method: one ``LinearMethod`` per expert matrix, so every
weight format (bf16, w8a16, w8a8, Q8_0) and its step-size dispatch hold per expert, each expert
stepping by its own token count. A fused CPU expert kernel is another ``MoEMethod``.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from pdserve.engine.model_executor.dp_attention import dense_mlp, mlp_reduces
from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan, Step
from pdserve.engine.model_executor.layers.linear_method import LinearMethod, linear_method
from pdserve.engine.model_executor.layers.ep_placement import ExpertPlacement, contiguous_placement
from pdserve.engine.model_executor.layers.moe_a2a import AllToAllExchange, ReplicatedExchange, row_share
from pdserve.engine.model_executor.parallel import HeadShard, all_gather_rows, moe_parallel, tp_rank, tp_size


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")
_EXPERT_SHARDS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w2": "w2", "w3": "w3"}


def expert_weight_name(name: str) -> tuple[str, str, int] | None:
    """``model.layers.3.mlp.experts.7.up_proj.weight`` (or Mixtral's ``w3``) -> (``model.layers.3.
    mlp.experts.weight``, "w3", 7): the ``FusedMoE`` at ``...experts``, its shard and expert; None
    for any other name. A model with experts returns this from its ``expert_weight_name``."""
    m = _EXPERT.fullmatch(name)
    return None if m is None else (f"{m.group(1)}.weight", _EXPERT_SHARDS[m.group(3)], int(m.group(2)))


class MoEMethod(ABC):
    """How E experts' weights are held and multiplied. w13: [E, 2 I, K] (gate | up of this rank's
    I intermediate rows), w2: [E, K, I]; under EP, E is this rank's experts (``FusedMoE`` sets
    ``num_experts`` to their count) and ids are local indices, < 0 for none."""

    def __init__(self, plan: KernelPlan, num_experts: int):
        self.plan = plan
        self.num_experts = num_experts

    @abstractmethod
    def prepare(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Build the forms from the loaded matrices (model dtype); they may be dropped afterwards."""

    @abstractmethod
    def apply(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, step: Step) -> torch.Tensor:
        """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]): x [T, K], topk_weights [T, k]
        float32, topk_ids [T, k] int64 -> [T, K] in x's dtype (this rank's partial sums under TP)."""

    @abstractmethod
    def dense(self, expert: int, shard_id: str) -> torch.Tensor:
        """Expert ``expert``'s float32 matrix ``shard_id`` ("w1" gate, "w3" up, "w2" down), this rank's."""


class PerExpertMoEMethod(MoEMethod):
    """Each expert a SwiGLU gate|up and a down ``LinearMethod``; tokens gathered per expert."""

    def prepare(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.w13: list[LinearMethod] = [linear_method(self.plan, swiglu=True) for _ in range(self.num_experts)]
        self.w2: list[LinearMethod] = [linear_method(self.plan) for _ in range(self.num_experts)]
        for e in range(self.num_experts):
            self.w13[e].prepare(w13[e])
            self.w2[e].prepare(w2[e])

    def apply(self, x, topk_weights, topk_ids, step):
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)  # [T, K]
        for e in topk_ids.unique().tolist():
            if e < 0:  # a slot whose expert another rank holds
                continue
            rows, slot = (topk_ids == e).nonzero(as_tuple=True)  # tokens routed to e
            expert_step = Step(rows.numel(), step.decode)
            y = self.w2[e].apply(self.w13[e].apply(x[rows], expert_step), expert_step)  # [n, K]
            out.index_add_(0, rows, y.float() * topk_weights[rows, slot, None])
        return out.to(x.dtype)

    def dense(self, expert: int, shard_id: str) -> torch.Tensor:
        if shard_id == "w2":
            return self.w2[expert].dense()
        w13 = self.w13[expert].dense()
        inter = w13.shape[0] // 2
        return w13[:inter] if shard_id == "w1" else w13[inter:]


# (rows, step) -> (topk_weights [T, k] float32, topk_ids [T, k] int64): a model's routing
Route = Callable[[torch.Tensor, Step], tuple[torch.Tensor, torch.Tensor]]
# (rows, step) -> this rank's unreduced share of the shared experts' output
Shared = Callable[[torch.Tensor, Step], torch.Tensor]


class FusedMoE:
    """E routed experts (SwiGLU), sharded over TP on the intermediate dimension, or placed whole
    on the EP ranks when ``parallel.init_ep`` set EP > 1. ``weight_loader`` takes a checkpoint
    expert matrix: ``shard_id`` "w1" (gate), "w3" (up) or "w2" (down) of ``expert_id`` (global;
    a rank keeps only the experts it holds); ``forward`` routes by the router's logits (softmax,
    top-k, renormalized when ``renormalize``), adds the residual after the group's reduction."""

    def __init__(self, plan: KernelPlan, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 tp: HeadShard, renormalize: bool = True, method: MoEMethod | None = None):
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp_size = tp.size
        ep = moe_parallel()
        if ep.ep_size > 1 and ep.ep_size * ep.moe_tp_size != tp.size:
            raise ValueError(f"ep_size {ep.ep_size} x {ep.moe_tp_size} does not make the TP group of {tp.size}")
        split, split_rank = (ep.moe_tp_size, ep.moe_tp_rank) if ep.ep_size > 1 else (tp.size, tp.rank)
        if intermediate % split:
            raise ValueError(f"tp_size {split} does not divide the experts' intermediate size {intermediate}")
        self.plan, self.hidden, self.ep = plan, hidden, ep
        self.ep_rank = ep.ep_rank
        inter = intermediate // split
        self.rows = slice(split_rank * inter, (split_rank + 1) * inter)
        self.inter = inter
        self.method = method or PerExpertMoEMethod(plan, num_experts)
        # expert statistics (``expert_recorder.py``): this layer's row of the counts while recording,
        # else None; a rank counts the slots routed to the experts it holds (one rank per EP rank).
        # ``load``: the same count for EPLB (``eplb.py``), None when it is off
        self.record: torch.Tensor | None = None
        self.load: torch.Tensor | None = None
        self.counts_tokens = ep.moe_tp_rank == 0 if ep.ep_size > 1 else tp.rank == 0
        self.exchange = None
        self.set_placement(contiguous_placement(num_experts, ep.ep_size))

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Hold the slots ``placement`` gives this rank, before the weights load (they are empty
        after this); ``install`` changes the placement of loaded weights."""
        self._use_placement(placement)
        n_local = placement.slots_per_rank
        self.w13: torch.Tensor | None = torch.empty(n_local, 2 * self.inter, self.hidden, dtype=self.plan.dtype,
                                                    device=self.plan.device)
        self.w2: torch.Tensor | None = torch.empty(n_local, self.hidden, self.inter, dtype=self.plan.dtype,
                                                   device=self.plan.device)

    def _use_placement(self, placement: ExpertPlacement) -> None:
        """The id maps of ``placement``: routing (logical -> physical), the exchange's, counting."""
        ep, dev = self.ep, self.plan.device
        if placement.num_logical != self.num_experts or placement.ep_size != ep.ep_size:
            raise ValueError(f"a placement of {placement.num_logical} experts over {placement.ep_size} EP ranks does "
                             f"not fit this layer's {self.num_experts} over {ep.ep_size}")
        self.placement = placement
        self.local_experts = placement.experts_of(ep.ep_rank)  # logical ids, by local index
        self.slots_of = [[i for i, e in enumerate(self.local_experts) if e == x] for x in range(self.num_experts)]
        local_of = torch.tensor(placement.local_ids(ep.ep_rank), dtype=torch.int64, device=dev)
        stats = getattr(self.exchange, "stats", None)
        if ep.a2a_backend == "gloo":
            owner = torch.tensor(placement.owner, dtype=torch.int64, device=dev)
            local_all = torch.tensor(placement.local, dtype=torch.int64, device=dev)
            self.exchange = AllToAllExchange(owner, local_all, ep.ep_rank, ep.ep_size)
        elif ep.a2a_backend == "deepep":
            from pdserve.engine.model_executor.layers.moe_a2a_deepep import DeepEPExchange

            self.exchange = DeepEPExchange(placement, ep.ep_rank, self.hidden, self.plan.dtype)
        else:
            self.exchange = ReplicatedExchange(local_of, reduce=mlp_reduces())
        if stats is not None:  # the all-to-all counters run on across a new placement
            self.exchange.stats = stats
        # routing: token t's slot for expert e is replicas[e, t % num_replicas[e]]
        self._identity = placement.is_identity
        self._replicas = torch.tensor(placement.replica_table(), dtype=torch.int64, device=dev)  # [E, R + 1]
        self._num_replicas = torch.tensor([len(r) for r in placement.replicas()], dtype=torch.int64, device=dev)
        held = [1 if self.counts_tokens and r == ep.ep_rank else 0 for r in placement.owner]
        self._held = torch.tensor(held, dtype=torch.int64, device=dev)  # [P]
        self.method.num_experts = placement.slots_per_rank

    def weight_loader(self, param: str, loaded: torch.Tensor, shard_id: str, expert_id: int) -> None:
        if shard_id not in ("w1", "w2", "w3"):
            raise ValueError(f"expert shard_id must be w1, w2 or w3, got {shard_id!r}")
        for e in self.slots_of[expert_id]:  # none where another EP rank holds this expert
            if shard_id == "w1":
                self.w13[e, : self.inter].copy_(loaded[self.rows])
            elif shard_id == "w3":
                self.w13[e, self.inter :].copy_(loaded[self.rows])
            else:
                self.w2[e].copy_(loaded[:, self.rows])

    def process_weights(self) -> None:
        """Hand the loaded matrices to the method (once)."""
        if self.w13 is None:
            return
        self.method.prepare(self.w13, self.w2)
        self.w13 = self.w2 = None

    def local_weights(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Local slot ``slot``'s (w13 [2 I, K], w2 [K, I]) in the model dtype, as loaded (unquantized
        methods give back exactly what they were given)."""
        dtype = self.plan.dtype
        w13 = torch.cat([self.method.dense(slot, "w1"), self.method.dense(slot, "w3")]).to(dtype)
        return w13, self.method.dense(slot, "w2").to(dtype)

    def install(self, placement: ExpertPlacement, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Switch to ``placement`` with this rank's new slots' weights w13 [S, 2 I, K], w2 [S, K, I]."""
        self._use_placement(placement)
        self.method.prepare(w13, w2)

    def read_back(self, param: str, shard_id: str, expert_id: int) -> torch.Tensor:
        """Expert ``expert_id``'s float32 matrix ``shard_id`` of this rank (``get_weights_by_name``);
        ValueError for an expert another EP rank holds."""
        if not self.slots_of[expert_id]:
            owners = sorted({self.placement.owner[p] for p in self.placement.replicas()[expert_id]})
            raise ValueError(f"expert {expert_id} is held by EP rank {owners[0]}, not this rank ({self.ep_rank})")
        return self.method.dense(self.slots_of[expert_id][0], shard_id)

    def physical_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, k] -> physical slots [T, k]: token t takes replica t mod n of its
        expert's n replicas, so a replicated expert's tokens split between them."""
        if self._identity:
            return topk_ids
        n = self._num_replicas[topk_ids]  # [T, k]
        col = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None] % n
        return self._replicas[topk_ids, col]

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, step: Step,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] -> residual + the experts' weighted sum over the group, [T, hidden]."""
        weights, ids = self.select_experts(router_logits)
        return self.forward_routed(x, weights, ids, step, residual)

    def forward_dp_attention(self, x: torch.Tensor, route: Route, step: Step, residual: torch.Tensor,
                             shared: Shared | None = None) -> torch.Tensor:
        """Under DP attention: this group's rows x [T, hidden] through every group's experts ->
        residual + the weighted sum (+ ``shared(rows, step)``, shared experts split like a dense MLP,
        unreduced). ``route(rows, step)``: (topk_weights, topk_ids) of rows. The all-to-all sends
        this group's own rows to their experts' ranks (the shared experts gathered apart; in a
        group of several ranks, which all hold the group's rows, each sends its share and the
        group gathers the sums); otherwise the groups' rows are gathered and each rank runs its
        experts on all of them (``dp_attention.dense_mlp``)."""
        if isinstance(self.exchange, AllToAllExchange):
            if shared is not None:
                residual = dense_mlp(lambda rows: shared(rows, Step(rows.shape[0], step.decode)), x, residual)
            shares = [row_share(x.shape[0], tp_size(), r) for r in range(tp_size())]
            start, end = shares[tp_rank()]
            mine = x[start:end]  # [t, hidden]
            # an idle rank routes no rows (a 0-row step would take the gemv path, which a plan may lack)
            if mine.shape[0]:
                weights, ids = route(mine, Step(mine.shape[0], step.decode))
            else:
                weights = x.new_empty(0, self.top_k, dtype=torch.float32)
                ids = torch.empty(0, self.top_k, dtype=torch.int64, device=x.device)
            # this rank's share alone reaches it: it counts all of it, whoever holds the slot
            physical = self._physical(ids, own_rows=True)
            y = self.exchange.exchange(mine, weights, physical, step, self.method.apply)
            if len(shares) > 1 and x.shape[0]:  # (the group's ranks agree: their rows are the same)
                y = all_gather_rows(y, [b - a for a, b in shares], tp_group=True)  # [T, hidden], the group's
            return residual + y

        def partial(rows: torch.Tensor) -> torch.Tensor:
            gathered = Step(rows.shape[0], step.decode)
            y = self.forward_routed(rows, *route(rows, gathered), gathered)
            return y if shared is None else y + shared(rows, gathered)

        return dense_mlp(partial, x, residual)

    def forward_routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, step: Step,
                       residual: torch.Tensor | None = None) -> torch.Tensor:
        """``forward`` with the routing chosen by the caller (a model's own gate): topk_weights
        [T, k] float32, topk_ids [T, k] int64 -> residual + the weighted sum over the group, [T, hidden]."""
        y = self.exchange.run(x, topk_weights, self._physical(topk_ids), step, self.method.apply)
        return y if residual is None else residual + y

    def _physical(self, topk_ids: torch.Tensor, own_rows: bool = False) -> torch.Tensor:
        """``physical_ids`` of the routed ``topk_ids``, counted into the expert statistics and EPLB's
        load while they record: by a rank that sees every row, the slots it holds (the ranks' counts
        sum to the whole); with ``own_rows`` (DP attention's all-to-all: each group sees only its
        own rows), every slot of them."""
        physical = self.physical_ids(topk_ids)
        if self.record is not None or self.load is not None:
            flat = topk_ids.reshape(-1)  # [T k]
            if own_rows:
                held = torch.full_like(flat, int(self.counts_tokens))
            else:
                held = self._held[physical.reshape(-1)]
            for counts in (self.record, self.load):
                if counts is not None:
                    counts.scatter_add_(0, flat, held)
        return physical
