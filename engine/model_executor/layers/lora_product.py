"""The LoRA product of a batch whose rows use different adapters (or none): segmented by adapter.

One projection's adapters sit in slot stacks, A [slots, r_max, in] and
B [slots, out, r_max] (a smaller rank padded with zeros, which add nothing), with
one scaling per slot. Each row names its slot (-1: the base model alone). The
rows of one slot are gathered and take two small products, so the cost is that
of the rows that use an adapter, whatever the mix; the delta is added into the
base product's output in place.

On the CPU in bf16 the product is the native segmented kernel (``kernels/cpu_lora.c``): rows
sorted by slot, one shrink over every part of the layer and one expand per group of a slot's
rows, the work of the rows that use an adapter alone (``LoraHook.apply``; the fused decode step
calls the same kernel inside its one call). Elsewhere (CUDA, float32), the torch forms below,
which are also the kernel's reference.

A step that mixes adapters takes the dense form, where it costs less than the base
product (``LoraHook.apply``): each layer's parts and slots stacked into one A [P*S*r, in] and
one B [out, P*S*r] (scaling folded into B), so the whole delta is two products whatever the mix,
the shrunk rows masked to their own slot's columns. Per-slot loops cost two small products per
slot and part (2 x 8 slots x 9 parts a layer at 8 adapters), which dominates a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.kernels.cpu_lora import LoraKernels, LoraWeights


class LoraStacks:
    """The adapters of one projection, by slot: zeros where a slot is empty or its adapter skips it."""

    def __init__(self, slots: int, r_max: int, in_features: int, out_features: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.a = torch.zeros(slots, r_max, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, out_features, r_max, dtype=dtype, device=device)
        self.scaling = [0.0] * slots
        self.used = [False] * slots  # the slot's adapter has weights for this projection
        self.version = 0  # changes with every set: the dense form's stacked copies follow it

    def set(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        """Put an adapter's A [r, in] and B [out, r] in ``slot`` (None: it does not touch this projection)."""
        self.version += 1
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.used[slot] = a is not None
        self.scaling[slot] = scaling
        if a is not None:
            r = a.shape[0]
            self.a[slot, :r].copy_(a)
            self.b[slot, :, :r].copy_(b)

    def clear(self, slot: int) -> None:
        self.set(slot, None, None, 0.0)

    def add_delta(self, y: torch.Tensor, x: torch.Tensor, segments: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        """y += scaling[s] * (x[rows] @ A[s].T) @ B[s].T for each (slot s, rows) of ``segments``; returns y.
        x: [T, in]; y: [T, out]; rows: int64 row indices."""
        x = x.to(self.a.dtype)
        for slot, rows in segments:
            if not self.used[slot]:
                continue
            if rows.numel() == x.shape[0]:  # every row on this adapter: no gather or scatter
                y.add_(((x @ self.a[slot].T) @ self.b[slot].T).to(y.dtype), alpha=self.scaling[slot])
                continue
            xs = x.index_select(0, rows)  # [n, in]
            delta = (xs @ self.a[slot].T) @ self.b[slot].T  # [n, out]
            y.index_add_(0, rows, delta.to(y.dtype), alpha=self.scaling[slot])
        return y


def segments_of(row_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, its rows) for each slot used in ``row_slots`` [T] (-1: no adapter), in slot order."""
    out = []
    for slot in torch.unique(row_slots).tolist():
        if slot >= 0:
            out.append((slot, (row_slots == slot).nonzero().flatten()))
    return out


@dataclass(frozen=True)
class LoraRows:
    """One step's rows by LoRA slot: ``row_slots`` [T] (-1: no adapter) and its ``segments``."""

    row_slots: torch.Tensor
    segments: list[tuple[int, torch.Tensor]]
    # the dense form's masks, made once a step for all layers: (parts, slots, rank) -> [T, P*S*r]
    masks: dict = field(default_factory=dict, compare=False, repr=False)
    # row_slots as the native kernel reads them ([T] int32 on the CPU), made once a step
    native_slots: list = field(default_factory=list, compare=False, repr=False)

    @property
    def mixed(self) -> bool:
        """More than one adapter, or some rows on none: the per-slot form would gather and loop."""
        return len(self.segments) > 1 or self.segments[0][1].numel() != self.row_slots.shape[0]

    def mask(self, parts: int, slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, parts*slots*rank]: 1 in the columns of each row's slot (in every part), else 0."""
        key = (parts, slots, rank, dtype)
        m = self.masks.get(key)
        if m is None:
            s = self.row_slots
            onehot = (s.unsqueeze(1) == torch.arange(slots, device=s.device)).to(dtype)  # [T, S]
            m = onehot.repeat_interleave(rank, dim=1).repeat(1, parts)
            self.masks[key] = m
        return m

    def slots32(self) -> torch.Tensor:
        """``row_slots`` [T] as contiguous int32 on the CPU (the native kernel's operand)."""
        if not self.native_slots:
            self.native_slots.append(self.row_slots.to("cpu", torch.int32).contiguous())
        return self.native_slots[0]

    @classmethod
    def of(cls, row_slots: torch.Tensor | None) -> "LoraRows | None":
        """None where no row uses an adapter, so such a step takes the base products alone."""
        if row_slots is None:
            return None
        segments = segments_of(row_slots)
        return cls(row_slots, segments) if segments else None

    def narrow(self, rows: torch.Tensor) -> "LoraRows | None":
        """The slots of ``rows`` alone (the last layer keeps the sampled rows)."""
        return LoraRows.of(self.row_slots.index_select(0, rows))


class LoraHook:
    """A linear layer's LoRA: per part of its output (q, k, v of a merged q|k|v; gate, up), the
    stacks of the adapters' A and B for that projection. ``swiglu``: the layer's weight is gate | up
    and SiLU(gate) * up is taken here, after the delta (the products stay unfused under LoRA)."""

    #: the stacked forms (below) where they apply (False: the per-slot loop always; the
    #: benchmark compares the two in one run)
    dense = True
    #: the native segmented kernel where it applies (False: the torch forms; the benchmark
    #: compares the two in one run)
    native = True

    def __init__(self, parts: list[tuple[slice, LoraStacks]], swiglu: bool, kernels: LoraKernels | None = None):
        self.parts = parts
        self.swiglu = swiglu
        self.kernels = kernels  # the native product (a bf16 model on the CPU), or None
        self._native: tuple[tuple[int, ...], LoraWeights] | None = None
        self.out_features = max((cols.stop for cols, _ in parts), default=0)  # the columns the parts cover
        # the stacked copies: (slot versions, dtype, A, B, {slot: that slot's A and B})
        self._stacked: tuple[tuple[int, ...], torch.dtype, torch.Tensor, torch.Tensor, dict] | None = None

    def _stacks(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """A [P*S*r, in] and B [out, P*S*r] of every part and slot, in ``dtype`` (the
        activations': bf16 products where the model runs bf16), B's columns scaled by their
        slot's scaling and placed at the part's output columns; rebuilt when a slot changed.
        The dict caches one slot's columns of both (``_slot_stacks``)."""
        versions = tuple(st.version for _, st in self.parts)
        if self._stacked is None or self._stacked[:2] != (versions, dtype):
            first = self.parts[0][1]
            slots, r, in_f = first.a.shape
            k = slots * r
            out = self.out_features
            a = torch.cat([st.a.reshape(k, in_f) for _, st in self.parts])
            b = torch.zeros(out, k * len(self.parts), dtype=first.b.dtype, device=first.b.device)
            for p, (cols, st) in enumerate(self.parts):
                scale = torch.tensor(st.scaling, dtype=st.b.dtype, device=st.b.device).repeat_interleave(r)
                # st.b [S, out_p, r] -> [out_p, S*r], slot-major as A's rows
                b[cols, p * k:(p + 1) * k] = st.b.permute(1, 0, 2).reshape(-1, k) * scale
            self._stacked = (versions, dtype, a.to(dtype), b.to(dtype), {})
        return self._stacked[2], self._stacked[3], self._stacked[4]

    def _slot_stacks(self, slot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's A [P*r, in] and B [out, P*r] (every part's, B block-diagonal)."""
        a, b, by_slot = self._stacks(dtype)
        if slot not in by_slot:
            parts = len(self.parts)
            slots, r, in_f = self.parts[0][1].a.shape
            by_slot[slot] = (a.view(parts, slots, r, in_f)[:, slot].reshape(parts * r, in_f),
                             b.view(b.shape[0], parts, slots, r)[:, :, slot].reshape(b.shape[0], parts * r))
        return by_slot[slot]

    def native_weights(self) -> LoraWeights:
        """Every part and slot as the native kernel reads them, bf16: A [S, P*r, in] (a slot's
        parts stacked, so one shrink serves q, k and v) and B transposed [S, r, out], each slot's
        scaling folded in; rebuilt when a slot changed."""
        versions = tuple(st.version for _, st in self.parts)
        if self._native is None or self._native[0] != versions:
            stacks = [st for _, st in self.parts]
            slots, r, in_f = stacks[0].a.shape
            a = torch.stack([st.a for st in stacks], dim=1).reshape(slots, len(stacks) * r, in_f)
            bt = torch.cat([(st.b * torch.tensor(st.scaling, dtype=st.b.dtype).view(-1, 1, 1)).transpose(1, 2)
                            for st in stacks], dim=2)  # [S, r, out]
            ends = []
            for cols, _ in self.parts:
                assert cols.start == (ends[-1] if ends else 0), "the parts cover the columns in order"
                ends.append(cols.stop)
            weights = LoraWeights(a.to(torch.bfloat16).contiguous(), bt.to(torch.bfloat16).contiguous(), ends)
            self._native = (versions, weights)
        return self._native[1]

    def runs_native(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """The native kernel takes this product: bf16 on the CPU, the parts covering y's columns."""
        return (self.native and self.kernels is not None and x.dtype == y.dtype == torch.bfloat16
                and x.device.type == "cpu" and x.stride(1) == 1 and y.stride(1) == 1 and self._covers(y.shape[1]))

    def _covers(self, out: int) -> bool:
        """The parts cover all ``out`` columns (every layer LoraManager builds)."""
        return self.out_features == out

    def _dense_pays(self, in_f: int, out: int) -> bool:
        """The dense form's two products (P*S*r wide) cost at most the base product's flops."""
        slots, r, _ = self.parts[0][1].a.shape
        k = len(self.parts) * slots * r
        return k * (in_f + out) <= in_f * out

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora: LoraRows | None) -> torch.Tensor:
        """y [T, out] (the base product of x [T, in]) plus each row's delta; SwiGLU after, if set.

        bf16 on the CPU: the native segmented kernel (``runs_native``). Otherwise, every row on one adapter: two products over that slot's parts stacked (P*r wide). Rows
        mixing adapters (or some on none): the dense form where it pays, two products over every
        part and slot stacked, each row's shrunk values masked to its own slot. Otherwise a loop
        over the slots and parts (``LoraStacks.add_delta``)."""
        if lora is not None and self.parts:
            stacked = self.dense and self._covers(y.shape[1])
            if self.runs_native(x, y):
                self.kernels.add(y, x, lora.slots32(), self.native_weights())
            elif stacked and not lora.mixed:
                a, b = self._slot_stacks(lora.segments[0][0], x.dtype)
                y.add_(((x @ a.T) @ b.T).to(y.dtype))
            elif stacked and self._dense_pays(x.shape[1], y.shape[1]):
                a, b, _ = self._stacks(x.dtype)
                slots, r, _ = self.parts[0][1].a.shape
                h = (x @ a.T).mul_(lora.mask(len(self.parts), slots, r, a.dtype))  # [T, P*S*r]
                y.add_((h @ b.T).to(y.dtype))  # [T, out]
            else:
                x = x.to(self.parts[0][1].a.dtype)  # once for the parts that share it (q, k, v; gate, up)
                for cols, stacks in self.parts:
                    stacks.add_delta(y[:, cols], x, lora.segments)
        if self.swiglu:
            inter = y.shape[1] // 2
            return torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
        return y
