"""The fused decode step's descriptor: a model's layers, final norm and LM head as the C structs of
``cpu_decode_layer.c`` (``DecodeStack``), run as one call of the native kernels (``cpu_native.py``)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pdserve.kernels.cpu_native import NativeKernels
from pdserve.kernels.gemm_layout import PanelWeight
from pdserve.kernels.gemv_layout import GemvWeight

_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class DecodeLayerDesc(ctypes.Structure):
    """``decode_layer_desc`` of cpu_decode_layer.c, field for field."""
    _fields_ = [(name, _P) for name in (
        "input_norm", "qkv_w", "qkv_scale", "qkv_bias", "o_w", "o_scale", "post_norm", "gate_up_w", "gate_up_scale",
        "down_w", "down_scale", "k_cache", "v_cache", "qkv_p", "o_p", "gate_up_p", "down_p",
        "lora_qkv", "lora_o", "lora_gate_up", "lora_down")]


class DecodeModelDesc(ctypes.Structure):
    """``decode_model_desc`` of cpu_decode_layer.c, field for field."""
    _fields_ = (
        [("layers", _P)]
        + [(name, _I64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "inter", "vocab",
                                     "int8", "page_size", "kv_slot_stride", "kv_head_stride")]
        + [(name, _P) for name in ("cos", "sin", "final_norm", "lm_head", "lm_head_scale", "attn",
                                   "x", "qkv", "qk", "attn_out", "attn_sel", "act", "h_sel")]
        + [("max_rows", _I64), ("lm_head_p", _P), ("gemv_rows", _I64), ("blocked", _I64), ("head_blocked", _I64),
           ("eps", _F), ("scale", _F), ("gate_up_plain", _I64), ("gu", _P), ("sel_slot", _P)]
    )


@dataclass(frozen=True)
class DecodeLayerTensors:
    """One layer as ``DecodeStack`` reads it. Weights packed for gemv, all bf16 or all int8; the
    K/V caches are the pool's per-layer tensors, passed to decode attention as
    ``NativeKernels.decode_attention`` passes them."""
    input_norm: torch.Tensor  # [hidden]
    qkv: GemvWeight  # [(H + 2 KVH) D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 KVH) D]
    o: GemvWeight  # [hidden, H D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: GemvWeight  # [2 inter, hidden]: gate | up, packed as SwiGLU (plain in a LoRA model)
    down: GemvWeight  # [hidden, inter]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    # the four in panels (bf16 with native gemm), for the steps past gemv's rows; else None
    panels: tuple[PanelWeight, PanelWeight, PanelWeight, PanelWeight] | None = None


@dataclass(frozen=True)
class DecodeShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    eps: float  # RMSNorm's
    scale: float  # attention's
    # elements between two slots and between two heads of a K/V cache tensor (its flat
    # ``[num_slots, heads, dim]`` view's strides), so the store holds for any pool layout
    kv_slot_stride: int
    kv_head_stride: int


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight_ptrs(w: GemvWeight) -> tuple[int, int | None]:
    return w.data.data_ptr(), _ptr(w.scale)


class DecodeStack:
    """A decode step's layers, final norm and LM head as one native call (``cpu_decode_layer.c``):
    bit-identical to calling ``rms_norm``, ``gemv`` (or past ``gemv_rows`` rows, ``gemm`` over
    the panels), ``rope``, the K/V store and ``decode_attention`` one by one, without their ~8
    calls and fresh tensors per layer. Holds every tensor it points to, and scratch for the
    largest step so far. bf16 activations only. ``lm_head_panels``: the LM head in panels, given
    where every layer has its panels too (then steps of any size run here). A LoRA model's gate|up
    is packed plain (not as SwiGLU): the call then takes SwiGLU after the product, and adds the
    adapters' deltas that ``set_lora`` names where a step gives its rows' slots."""

    def __init__(self, kernels: NativeKernels, shape: DecodeShape, layers: list[DecodeLayerTensors],
                 final_norm: torch.Tensor, lm_head: GemvWeight, cos: torch.Tensor, sin: torch.Tensor, gemv_rows: int,
                 lm_head_panels: PanelWeight | None = None):
        H, KVH, D = shape.num_heads, shape.num_kv_heads, shape.head_dim
        hidden = final_norm.numel()
        inter = layers[0].gate_up.rows // 2
        int8 = lm_head.scale is not None
        plain = not layers[0].gate_up.swiglu  # a LoRA model's: SwiGLU after the delta
        for t in (*(getattr(layer, f) for layer in layers for f in ("input_norm", "post_norm", "k_cache", "v_cache")),
                  final_norm, cos, sin):
            assert t.is_contiguous() and t.dtype == torch.bfloat16, "contiguous bf16 tensors"
        # the C side trusts these: each weight's shape, SwiGLU packing and type
        want = {"qkv": ((H + 2 * KVH) * D, hidden, False), "o": (hidden, H * D, False),
                "gate_up": (2 * inter, hidden, not plain), "down": (hidden, inter, False)}
        for layer in layers:
            for name, (rows, cols, swiglu) in want.items():
                w = getattr(layer, name)
                assert (w.rows, w.cols, w.swiglu, w.scale is not None) == (rows, cols, swiglu, int8), name
                assert w.blocked == layers[0].qkv.blocked, "the layers' int8 scales all per row or all per chunk"
        assert lm_head.cols == hidden and not lm_head.swiglu and cos.shape[1] == D
        if lm_head_panels is not None:
            assert all(layer.panels is not None for layer in layers) and not int8
            for layer in layers:
                for w, name in zip(layer.panels, want):
                    assert (w.rows, w.cols, w.swiglu) == want[name], name
            assert (lm_head_panels.rows, lm_head_panels.cols) == (lm_head.rows, hidden)
        self._kernels = kernels
        self._keep = (layers, final_norm, lm_head, cos, sin, lm_head_panels)
        self._widths = {"x": hidden, "qkv": (H + 2 * KVH) * D, "qk": (H + KVH) * D, "attn_out": H * D,
                        "attn_sel": H * D, "act": inter, "h_sel": hidden}
        self._layer_descs = (DecodeLayerDesc * len(layers))(*(DecodeLayerDesc(
            _ptr(layer.input_norm), *_weight_ptrs(layer.qkv), _ptr(layer.qkv_bias), *_weight_ptrs(layer.o),
            _ptr(layer.post_norm), *_weight_ptrs(layer.gate_up), *_weight_ptrs(layer.down), _ptr(layer.k_cache),
            _ptr(layer.v_cache), *((None,) * 4 if lm_head_panels is None else (_ptr(w.data) for w in layer.panels)),
            None, None, None, None)
            for layer in layers))
        self._lora: list[tuple[int | None, ...]] = [(None,) * 4] * len(layers)
        attn_fn = kernels.decode_attention_fn(torch.bfloat16, D)
        self._desc = DecodeModelDesc(
            ctypes.addressof(self._layer_descs), len(layers), hidden, H, KVH, D, inter, lm_head.rows, int(int8),
            shape.page_size, shape.kv_slot_stride, shape.kv_head_stride, _ptr(cos), _ptr(sin), _ptr(final_norm),
            *_weight_ptrs(lm_head), ctypes.cast(attn_fn, _P).value, *(None,) * len(self._widths), 0,
            None if lm_head_panels is None else _ptr(lm_head_panels.data), gemv_rows, int(layers[0].qkv.blocked),
            int(lm_head.blocked), shape.eps, shape.scale, int(plain), None, None,
        )
        self._desc_ptr = ctypes.addressof(self._desc)
        self._widths["gu"] = 2 * inter if plain else 1  # scratch past the desc's positional ones
        self._scratch: dict[str, torch.Tensor] = {}
        self._grow(gemv_rows)
        self.num_layers = len(layers)
        self.vocab = lm_head.rows
        self.gemv_rows = gemv_rows
        self._row_limit = gemv_rows if lm_head_panels is None else None  # None: any (the scratch grows)

    def _grow(self, rows: int) -> None:
        """Scratch for steps of up to ``rows`` rows (kept, and grown as larger steps come)."""
        if rows <= self._desc.max_rows:
            return
        self._scratch = {name: torch.empty(rows, n, dtype=torch.bfloat16) for name, n in self._widths.items()}
        self._scratch["sel_slot"] = torch.empty(rows, dtype=torch.int32)
        for name, t in self._scratch.items():
            setattr(self._desc, name, t.data_ptr())
        self._desc.max_rows = rows

    def set_lora(self, layer: int, weights: tuple[int | None, int | None, int | None, int | None]) -> None:
        """Layer ``layer``'s LoRA adapters: the addresses of the ``cpu_lora.LoraWeights``
        descriptors of q|k|v, o, gate|up and down (None: no adapter on that product). The caller
        keeps them alive while they are set; a plain gate|up (a LoRA model) is required."""
        assert self._desc.gate_up_plain or weights == (None,) * 4
        if self._lora[layer] != weights:
            d = self._layer_descs[layer]
            d.lora_qkv, d.lora_o, d.lora_gate_up, d.lora_down = weights
            self._lora[layer] = weights

    @property
    def lora_layers(self) -> int:
        """How many layers have adapters set (``set_lora``)."""
        return sum(any(w is not None for w in layer) for layer in self._lora)

    def run(self, h: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor, page_table: torch.Tensor,
            seq_lens: torch.Tensor, first: int, last: int, sel: torch.Tensor, logits: torch.Tensor | None,
            row_slots: torch.Tensor | None = None) -> None:
        """Layers ``[first, last)`` of a step of one token for each of ``M`` sequences.

        h: [M, hidden] bf16 contiguous, the residual stream, updated in place; positions, loc: [M]
        int64 (the tokens' positions and slots); page_table: [M, P] int32 contiguous; seq_lens: [M]
        int32. Where ``last`` is the last layer: the rows ``sel`` [nsel] int64 go on past its
        attention, then ``logits`` [nsel, vocab] gets the LM head's output: bf16, float32 in a
        step past ``gemv_rows`` (``logits_dtype``). ``row_slots`` [M] int32: each row's LoRA slot
        (-1: none; the adapters ``set_lora`` named), or None where no row uses one."""
        for t, dtype in ((positions, torch.int64), (loc, torch.int64), (sel, torch.int64), (page_table, torch.int32),
                         (seq_lens, torch.int32), (h, torch.bfloat16),
                         *(() if row_slots is None else ((row_slots, torch.int32),))):
            assert t.dtype == dtype and t.is_contiguous()
        rows = h.shape[0]
        assert self._row_limit is None or rows <= self._row_limit
        assert row_slots is None or (row_slots.shape == (rows,) and self._desc.gate_up_plain)
        assert logits is None or (logits.is_contiguous() and logits.shape == (sel.numel(), self.vocab)
                                  and logits.dtype == self.logits_dtype(rows))
        self._grow(rows)
        rc = self._kernels.decode_layers(
            self._desc_ptr, h.data_ptr(), h.shape[0], positions.data_ptr(), loc.data_ptr(), page_table.data_ptr(),
            page_table.stride(0), seq_lens.data_ptr(), first, last, sel.data_ptr(), sel.numel(), _ptr(logits),
            _ptr(row_slots))
        if rc != 0:
            raise RuntimeError(f"native decode layers failed with code {rc}")

    def logits_dtype(self, rows: int) -> torch.dtype:
        return torch.float32 if rows > self.gemv_rows else torch.bfloat16
