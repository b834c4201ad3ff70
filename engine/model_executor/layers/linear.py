"""Tensor-parallel linear layers that own their weights (nano-vllm's ``weight_loader``).

Each layer allocates this rank's share of its matrix, copies checkpoint tensors into it through
``weight_loader`` (slicing rows for column-parallel layers, columns for row-parallel ones, and
stacking the parts of a merged one: q | k | v, gate | up), and hands the result to its
``LinearMethod`` in ``process_weights``. A GGUF file's Q8_0 int8 takes the same path through
``load_q8_0`` where the method keeps int8 weights.

Column-parallel then row-parallel: each rank keeps its query and KV heads' rows of q|k|v and
the matching columns of o, its 1/tp of the intermediate rows of gate|up and columns of down,
so a dense layer needs one all-reduce after o and one after down.
"""

from __future__ import annotations

import torch

from pdserve.engine.model_executor.layers.kernel_plan import KernelPlan, Step
from pdserve.engine.model_executor.layers.linear_method import LinearMethod, linear_method
from pdserve.engine.model_executor.layers.lora_product import LoraHook
from pdserve.engine.model_executor.parallel import HeadShard, all_reduce
from pdserve.engine.model_executor.quantization import Q8_0_BLOCK, Int8Weight

_ALL = slice(None)


class LinearBase:
    """W [out_rows, in_cols] of this rank, built from named parts: ``parts`` maps a shard id
    (None for an unmerged layer) to (rows in W, rows of the checkpoint tensor, its columns).
    The matrix is allocated at its first part and handed to the method as soon as every part
    is in, so a model's load holds one layer's plain matrix at a time, not all of them."""

    def __init__(self, plan: KernelPlan, out_rows: int, in_cols: int,
                 parts: dict[str | None, tuple[slice, slice, slice]], bias: bool = False, swiglu: bool = False,
                 method: LinearMethod | None = None):
        self.plan = plan
        self.parts = parts
        self.shape = (out_rows, in_cols)
        self.weight: torch.Tensor | None = None  # [out_rows, in_cols] while loading
        self.bias = torch.empty(out_rows, dtype=plan.dtype, device=plan.device) if bias else None
        # under LoRA the delta goes in before SwiGLU: the method keeps gate | up unfused
        self.method = method or linear_method(plan, swiglu and not plan.lora)
        self.swiglu = swiglu
        # the adapters' A and B for this layer (model_executor/lora_manager.py attaches them); an
        # unfused gate | up takes its SwiGLU there even while no adapter targets it
        self.lora: LoraHook | None = LoraHook([], swiglu=True) if swiglu and plan.lora else None
        self.processed = False
        params = ("weight", "bias") if bias else ("weight",)
        self._want = {(p, s) for p in params for s in parts}
        self._loaded: set[tuple[str, str | None]] = set()
        self._q8_0: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}

    def weight_loader(self, param: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """Copy this rank's share of checkpoint tensor ``loaded`` (``param``: "weight" or "bias")
        into its rows of the merged matrix."""
        dst_rows, src_rows, src_cols = self.parts[shard_id]
        if param == "weight" and self.weight is None:
            self.weight = torch.empty(self.shape, dtype=self.plan.dtype, device=self.plan.device)
        target = self.weight if param == "weight" else self.bias
        if target is None or self.processed:
            raise ValueError(f"this layer has no {param} to load")
        src = loaded[src_rows] if loaded.dim() == 1 else loaded[src_rows, src_cols]
        target[dst_rows].copy_(src)
        self._loaded.add((param, shard_id))
        if self._loaded >= self._want:
            self.process_weights()

    def load_q8_0(self, q: torch.Tensor, d: torch.Tensor, shard_id: str | None = None) -> bool:
        """Keep a GGUF Q8_0 matrix's int8 ``q`` [N, K] and block scales ``d`` [N, K / 32] as stored
        for this part; False where this rank's columns cut a block (then the dense copy is quantized)."""
        _, src_rows, src_cols = self.parts[shard_id]
        start, stop, _ = src_cols.indices(q.shape[1])
        if start % Q8_0_BLOCK or stop % Q8_0_BLOCK:
            return False
        self._q8_0[shard_id] = (q[src_rows, start:stop], d[src_rows, start // Q8_0_BLOCK: stop // Q8_0_BLOCK])
        return True

    @property
    def has_q8_0(self) -> bool:
        """Every part arrived as Q8_0 (``load_q8_0``)."""
        return set(self._q8_0) == set(self.parts)

    def drop_q8_0(self) -> None:
        self._q8_0.clear()

    def check_loaded(self, name: str) -> None:
        missing = sorted(f"{p}:{s}" for p, s in self._want - self._loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weight parts {missing} of {name!r}")

    def process_weights(self, pad_rows: int | None = None) -> None:
        """Hand the loaded matrix (or its Q8_0 parts, stacked) to the method; the method's forms
        replace it. ``pad_rows``: zero rows appended up to that many (a vocabulary shard). Once."""
        if self.processed:
            return
        q8 = None
        if self.has_q8_0 and self.plan.quantized and not self.plan.a8:  # w8a16 only
            qs, ds = zip(*(self._q8_0[s] for s in self.parts))
            q, d = torch.cat(qs), torch.cat(ds)
            if pad_rows is not None and pad_rows > q.shape[0]:
                q = torch.cat([q, q.new_zeros(pad_rows - q.shape[0], q.shape[1])])
                d = torch.cat([d, d.new_zeros(pad_rows - d.shape[0], d.shape[1])])
            q8 = Int8Weight.from_q8_0(q, d)
        w = self.weight
        if pad_rows is not None and w.shape[0] < pad_rows:
            w = torch.cat([w, w.new_zeros(pad_rows - w.shape[0], w.shape[1])])
        self.method.prepare(w, q8)
        self.weight = None
        self._q8_0.clear()
        self.processed = True

    @property
    def q8_0(self) -> bool:
        """The method's int8 came from Q8_0 blocks (per-chunk scales)."""
        g = self.method.large if self.method.gemv is None else self.method.gemv
        return getattr(g, "scale", None) is not None and g.scale.dim() == 2

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        if self.lora is not None:
            return self.lora.apply(self.method.apply(x, step, bias=self.bias), x, step.lora)
        return self.method.apply(x, step, bias=self.bias)

    def read_back(self, param: str = "weight", shard_id: str | None = None) -> torch.Tensor:
        """This rank's float32 rows of part ``shard_id`` (``get_weights_by_name``)."""
        rows = self.parts[shard_id][0]
        if param == "bias" and self.bias is not None:
            return self.bias[rows].float()
        if param != "weight":
            raise ValueError(f"this layer has no {param}")
        return self.method.dense()[rows]


class ColumnParallelLinear(LinearBase):
    """y = x @ W.T with W's rows split over the TP ranks; output stays split."""

    def __init__(self, plan: KernelPlan, in_cols: int, out_rows: int, tp: HeadShard, bias: bool = False):
        n = out_rows // tp.size
        rows = slice(tp.rank * n, (tp.rank + 1) * n)
        super().__init__(plan, n, in_cols, {None: (slice(0, n), rows, _ALL)}, bias)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel matrices of equal width stacked (gate | up: ``shard_ids`` "0", "1"
    or names); ``swiglu``: the method returns SiLU(gate) * up."""

    def __init__(self, plan: KernelPlan, in_cols: int, out_rows: int, tp: HeadShard, shard_ids: tuple[str, ...],
                 swiglu: bool = False):
        n = out_rows // tp.size
        rows = slice(tp.rank * n, (tp.rank + 1) * n)
        parts = {s: (slice(i * n, (i + 1) * n), rows, _ALL) for i, s in enumerate(shard_ids)}
        super().__init__(plan, n * len(shard_ids), in_cols, parts, swiglu=swiglu)


class QKVParallelLinear(LinearBase):
    """q | k | v of this rank's heads (``tp``: its query heads and its KV heads, split or replicated)."""

    def __init__(self, plan: KernelPlan, hidden: int, head_dim: int, tp: HeadShard, bias: bool = False):
        H, KVH, D = tp.num_heads, tp.num_kv_heads, head_dim
        q_rows = slice(tp.q_start * D, (tp.q_start + H) * D)
        kv_rows = slice(tp.kv_start * D, (tp.kv_start + KVH) * D)
        parts = {"q": (slice(0, H * D), q_rows, _ALL), "k": (slice(H * D, (H + KVH) * D), kv_rows, _ALL),
                 "v": (slice((H + KVH) * D, (H + 2 * KVH) * D), kv_rows, _ALL)}
        super().__init__(plan, (H + 2 * KVH) * D, hidden, parts, bias)


class ReplicatedLinear(LinearBase):
    """y = x @ W.T with the whole W on every rank (a router's gate, say)."""

    def __init__(self, plan: KernelPlan, in_cols: int, out_rows: int, bias: bool = False):
        super().__init__(plan, out_rows, in_cols, {None: (slice(0, out_rows), _ALL, _ALL)}, bias)


class RowParallelLinear(LinearBase):
    """y = x @ W.T with W's columns split evenly over the TP ranks (the column-parallel layer
    before it split its output rows so): each rank's partial sums are all-reduced, and the
    residual added (fused into the product at TP 1, where no collective sits between them).
    ``reduce`` False: the caller sums the partial sums itself (DP attention's dense layers, whose
    split spans more ranks than the TP group)."""

    def __init__(self, plan: KernelPlan, in_cols: int, out_rows: int, tp: HeadShard, reduce: bool = True):
        self.reduces = reduce and tp.size > 1  # an all-reduce follows the product
        n = in_cols // tp.size
        cols = slice(tp.rank * n, (tp.rank + 1) * n)
        super().__init__(plan, out_rows, n, {None: (slice(0, out_rows), _ALL, cols)})

    def forward(self, x: torch.Tensor, step: Step, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + all_reduce(x @ W.T) (without ``residual``: the all-reduced product; without
        ``reduces``, this rank's partial product)."""
        if self.lora is not None:  # this rank's partial delta joins its partial sums before the reduce
            y = self.lora.apply(self.method.apply(x, step), x, step.lora)
            if self.reduces:
                y = all_reduce(y)
            return y if residual is None else residual + y
        if not self.reduces:
            return self.method.apply(x, step, residual=residual)
        y = all_reduce(self.method.apply(x, step))
        return y if residual is None else residual + y
