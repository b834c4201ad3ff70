"""The LoRA product of a batch whose rows use different adapters (or none): segmented by adapter.

One projection's adapters sit in slot stacks, A [slots, r_max, in] and
B [slots, out, r_max] (a smaller rank padded with zeros, which add nothing), with
one scaling per slot. Each row names its slot (-1: the base model alone). The
rows of one slot are gathered and take two small products, so the cost is that
of the rows that use an adapter, whatever the mix; the delta is added into the
base product's output in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LoraStacks:
    """The adapters of one projection, by slot: zeros where a slot is empty or its adapter skips it."""

    def __init__(self, slots: int, r_max: int, in_features: int, out_features: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.a = torch.zeros(slots, r_max, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, out_features, r_max, dtype=dtype, device=device)
        self.scaling = [0.0] * slots
        self.used = [False] * slots  # the slot's adapter has weights for this projection

    def set(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None, scaling: float) -> None:
        """Put an adapter's A [r, in] and B [out, r] in ``slot`` (None: it does not touch this projection)."""
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

    def __init__(self, parts: list[tuple[slice, LoraStacks]], swiglu: bool):
        self.parts = parts
        self.swiglu = swiglu

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora: LoraRows | None) -> torch.Tensor:
        """y [T, out] (the base product of x [T, in]) plus each row's delta; SwiGLU after, if set."""
        if lora is not None and self.parts:
            x = x.to(self.parts[0][1].a.dtype)  # once for the parts that share it (q, k, v; gate, up)
            for cols, stacks in self.parts:
                stacks.add_delta(y[:, cols], x, lora.segments)
        if self.swiglu:
            inter = y.shape[1] // 2
            return torch.nn.functional.silu(y[:, :inter]) * y[:, inter:]
        return y
