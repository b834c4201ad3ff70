"""One model for the Llama family: Llama, SmolLM2, Mistral (no sliding window), Qwen2, Qwen3.

Differences are switches on ModelArch: q/k/v bias (Qwen2), per-head q/k
RMSNorm before rope (Qwen3). Weights arrive with Hugging Face names and are
fused at load (q|k|v into one matrix, gate|up into one) so a layer is four
matmuls. The forward is plain functions over tensors rather than nn.Module
calls: at decode a step runs ~20 small ops per layer and module dispatch
would be a visible share of it.

In bfloat16 on a CPU with AVX-512 BF16 (and no AMX), weights are packed once in panels for the
native products (``kernels/cpu_gemm.c``, ``gemm_layout.PanelWeight``), which fuse the residual
adds, q|k|v's bias and SiLU(gate) * up into their epilogues as oneDNN's post-ops do. They run
the default model's 64-row decode products 1.12-1.18x oneDNN's prepacked linears with the
weights coming from memory, as in a step (43.5 ms against 48.7 on two Zen 4 cores), and within
3 % of them at prefill sizes (``scripts/bench_gemm.py``). Elsewhere (``gemm=False``, ``--disable-native-gemm``,
or AMX, where oneDNN's AMX kernels are the faster path) the weights are prepacked for oneDNN
(``mkldnn._linear_pointwise``, the path torch.compile's CPU backend uses): about 2x faster than
plain ``F.linear`` at one token, ~20% at 64, with the same fusions as post-ops. RMSNorm and rope
run as the native kernels' one-pass versions (same roundings) on either.

Decode steps of up to ``GEMV_MAX_ROWS`` tokens take the native ``gemv`` kernels instead
(``kernels/cpu_gemv.c``): at one token a step is a stream over the weights, and oneDNN's
prepacked linear streams them at about half the rate a plain read reaches on this CPU, the
gemv loop at the plain read's rate (the LM head, one core: 35 GB/s against a sum's 34 and
oneDNN's 19; scripts/profile_decode_step.py). gemv reads its own copy of each weight, packed
once at load so that the whole step is one sequential stream (``kernels/gemv_layout.py``), so a
bf16 model keeps it beside the panels (or oneDNN's prepacked copy): the default model, 270 MB more.
With ``quantization="w8a16"`` every linear (and the LM head) is per-channel int8
(``quantization.Int8Weight``), packed the same way where gemv runs: multiplied in place by
gemv and dequantized per matrix for larger steps; the embedding lookup stays in the model dtype.
``quantization="w8a8"`` keeps those int8 weights and small steps, and runs a large step's
linears as int8 x int8 products over per-token int8 activations (``quantization.int8_linear``),
which read a row-major int8 copy beside gemv's packed one (the default model: 135 MB more). An
int8 LM head keeps its input in the model dtype under either (``INT8_HEAD_GEMV_ROWS``).

Such a step, where every row is a sequence's next token, runs its layers in one native call
(``cpu_native.DecodeStack``, ``kernels/cpu_decode_layer.c``): the same kernels in the same order
on preallocated scratch, bit-identical to the op-by-op path below, without its ~8 ctypes calls and
torch ops per layer. Only at TP 1 (an all-reduce sits inside each layer otherwise) and without
Qwen3's q/k norm (torch's float32 mean there is not the C kernel's sum order).

Tensor parallel (``tp`` a HeadShard of size > 1): each rank keeps its query and KV heads' rows
of q|k|v and the matching columns of o (column-parallel, then row-parallel), its 1/tp of the
intermediate rows of gate|up and columns of down, so a layer needs one all-reduce after o and
one after down. The embedding lookup is replicated (a gather of T rows: sharding it would
only add an all-reduce) but the LM head is split by vocabulary and its logits all-gathered:
measured on this machine (Zen 4, 1 thread, bf16 prepacked), the full 49152 x 576 head takes
3.0 ms per decode token against 1.0 ms for half of it, while gathering half a row of float32
logits costs ~0.1 ms, so a replicated head would cost each TP-2 rank ~2 ms of every step.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.mem_cache.forward_batch import ForwardBatch
from pdserve.engine.model_executor.model_config import ModelArch
from pdserve.engine.model_executor.parallel import HeadShard, all_gather_last_dim, all_reduce, head_shard
from pdserve.engine.model_executor.quantization import Int8Weight, dense, int8_linear, q8_0_matrix
from pdserve.engine.quantization_names import UNQUANTIZED, W8A8, W8A16, check_quantization
from pdserve.kernels.amx_layout import AmxInt8Weight
from pdserve.engine.model_executor.attention.attention_backend import AttentionBackend
from pdserve.kernels.cpu_int8_act import Int8ActKernels
from pdserve.kernels.cpu_native import DecodeLayerTensors, DecodeShape, DecodeStack, native_kernels
from pdserve.kernels.gemm_layout import PanelWeight
from pdserve.kernels.gemv_layout import GemvWeight

# Steps of at most this many tokens run their linears through native gemv. Measured on one
# Zen 4 core (load 3.2, best of 15) on the default model's LM head against the prepacked oneDNN
# linear: gemv 1.6x ahead at 1-2 rows, 1.2x at 3, 0.9x at 4, 0.6x at 6 and 8 (from 3 rows on
# it is bound by vdpbf16ps, ~1.1 ns each here, not by memory); whole decode steps through the
# fused step 2.4x oneDNN's at one row, 1.2x at 4 (scripts/profile_decode_step.py, load 3.5-3.8).
GEMV_MAX_ROWS = 4
# An int8 LM head over at most this many sampled rows (a prefill samples one per sequence) runs
# gemv in place at any step size rather than dequantizing 49152 x 576 weights for a few rows.
# Measured on one Zen 4 core (loaded machine, best of 5), default model's head: gemv 6.5 ms at 8
# rows, 62 at 64, 124 at 128; dequantized 190, 230, 316 ms. Its input stays in the model dtype
# under w8a8 too: per-token int8 there raised the default model's perplexity 2.2% over bf16
# against 1.6% with the head's input in bf16 (tests/model/test_w8a16_default_model.py's text).
INT8_HEAD_GEMV_ROWS = 128
# w8a16 where the CPU has AMX-BF16 (``NativeKernels.w8_amx_linear``, over gemv's int8): steps of more
# than gemv's rows and at most this many run their linears there; larger ones (prefill chunks)
# dequantize each matrix into torch's linear as before. The default model's 30 layers of linears,
# Emerald Rapids, 2 threads, in cache: 16 rows 17.4 ms against 35.0, 64 rows 23.7 against 41.8 (bf16
# oneDNN 22.3), 256 rows 79.6 against 78.3, 1024 rows 287 against 305; a prefill of 8 x 512 in
# steps of 2048 tokens ran 0.68x through it (each block of 256 tokens widens the weights again).
W8_AMX_MAX_ROWS = 256
# ...and its int8 LM head over more than this many sampled rows (gemv up to it), at any step size:
# 8 rows 3.7 ms against gemv's 3.1, 16 rows 4.3 against 7.9, 64 rows 8.9 against 35.4.
W8_AMX_HEAD_MIN_ROWS = 8

Weight = torch.Tensor | Int8Weight | GemvWeight | PanelWeight | AmxInt8Weight


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    # H, KVH and inter are this TP rank's shares (the whole model's at TP 1)
    # the forms larger steps read: plain, oneDNN-prepacked, PanelWeight (native gemm) or int8
    qkv_w: Weight  # [(H + 2 KVH) * D, hidden]
    qkv_b: torch.Tensor | None  # [(H + 2 KVH) * D]
    qk_norm: torch.Tensor | None  # [H + KVH, D]: q_norm repeated per q head, then k_norm per kv head
    o_w: Weight  # [hidden, H * D]
    post_norm: torch.Tensor  # [hidden]
    gate_up_w: Weight | None  # [2 * inter, hidden]; None when prepacked for oneDNN (gate_w, up_w instead)
    down_w: Weight  # [hidden, inter]
    gate_w: torch.Tensor | None = None  # packed [inter, hidden]
    up_w: torch.Tensor | None = None  # packed [inter, hidden]
    # the same matrices packed for native gemv, bf16 or int8 (w8a16: Int8Weight where gemv is off,
    # None in bf16 where it is off)
    qkv_g: Weight | None = None
    o_g: Weight | None = None
    gate_up_g: Weight | None = None  # [2 * inter, hidden]: gate | up, packed as SwiGLU
    down_g: Weight | None = None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as transformers' LlamaRMSNorm: statistics in float32, round to the model dtype, then scale
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """[D / 2] float32 inverse frequencies, with llama3 or linear scaling as transformers does it."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if arch.rope_linear_factor != 1.0:
        inv_freq = inv_freq / arch.rope_linear_factor
    if arch.rope_llama3_scaling is not None:
        factor, low, high, orig = arch.rope_llama3_scaling
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def can_prepack(dtype: torch.dtype, device: torch.device, cpu_has_bf16: bool) -> bool:
    """oneDNN prepacked bf16 linears: CPU, bf16, native bf16 instructions, op present in this torch."""
    return (
        device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_bf16
        and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 64)


class LlamaForCausalLM:
    def __init__(self, arch: ModelArch, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, prepack: bool = False, tp: HeadShard | None = None,
                 quantization: str = "none", gemv: bool = True, fused_decode: bool = True, gemm: bool = True,
                 q8_0: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None):
        """``prepack``: CPU bf16 with native bf16 (``can_prepack``): oneDNN's prepacked linears.
        A bf16 model on CPU runs the native norm/rope kernels either way. ``gemv``: small steps
        through native gemv where it is available (bf16 on CPU, AVX-512 BF16 or AVX2).
        ``fused_decode``: small decode steps' layers in one native call where gemv is on (TP 1, no
        q/k norm). ``gemm``: larger steps' bf16 products through the native panel kernels where
        they are available (AVX-512 BF16 without AMX), else oneDNN's prepacked linears.
        ``quantization``: ``none``, ``w8a16`` or ``w8a8``. ``q8_0``: a GGUF file's Q8_0
        matrices as stored (``model_loader.read_q8_0_blocks``): w8a16 keeps their int8 weights and
        block scales where every layer's matrices are Q8_0 (and the LM head's where it is),
        instead of quantizing the dequantized ones again."""
        check_quantization(quantization)
        arch.check_tp_size(1 if tp is None else tp.size)
        tp = tp or head_shard(0, 1, arch.num_heads, arch.num_kv_heads)
        self.arch = arch
        self.tp = tp
        self.dtype = dtype
        self.device = device
        self.quantization = quantization
        quant = quantization != UNQUANTIZED
        # w8a8: a large step's linears int8 x int8; native passes around the product where the model
        # runs the native kernels (bf16 on CPU), torch ops otherwise
        self.a8 = quantization == W8A8
        # w8a16 keeps int8 only: the large steps dequantize rather than use prepacked copies
        self.packed = prepack and not quant
        # bf16 on a CPU without native bf16 (AVX2 only): torch's bf16 matmul runs there at ~1 GFLOP/s
        # against float32's ~70 (Zen 1, 2 threads), so the plain path's linears multiply in float32,
        # each weight widened per call, rounding once to bf16 as the bf16 product does
        cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16
        self.upcast = cpu_bf16 and not prepack
        # the native kernels (fused bf16 RMSNorm and rope, gemv, the fused step) for any bf16 model on
        # CPU, with native bf16 instructions or not (gemv has AVX2 kernels too)
        self.native = native_kernels() if cpu_bf16 else None
        self.int8_act = Int8ActKernels(self.native) if self.a8 and self.native is not None else None
        amx = self.int8_act is not None and self.int8_act.has_amx
        # a bf16 model's larger steps: native panel products (one packed copy in place of oneDNN's)
        self.gemm = self.packed and gemm and self.native.has_gemm
        use_gemv = gemv and self.native is not None and self.native.has_gemv
        # w8a16's steps past gemv's rows on AMX-BF16 over gemv's int8 (``NativeKernels.w8_amx_linear``)
        # rather than each matrix dequantized into torch's linear; w8a8's decode steps likewise (its
        # activations stay bf16 in decode steps, as in gemv's: int8 ones are its prefill's)
        self.w8_amx = quant and use_gemv and self.native.has_w8_amx
        self.gemv_rows = GEMV_MAX_ROWS if use_gemv else 0
        # decode steps of at most this many rows run as one DecodeStack call (0: never); any number
        # where the model holds panels too (the larger steps' products are then gemm's)
        fused = fused_decode and self.gemv_rows > 0 and tp.size == 1 and not arch.qk_norm
        self.fused_rows = (sys.maxsize if self.gemm else self.gemv_rows) if fused else 0
        # built at the first fused step for its page pool, known by (id, first K tensor's address)
        self.decode_stack: DecodeStack | None = None
        self._stack_pool: tuple[int, int] | None = None
        packed = self.packed

        def forms(t: torch.Tensor, swiglu: bool = False,
                  q8: Int8Weight | None = None) -> tuple[Weight | None, Int8Weight | None]:
            """(the form small steps read, the row-major int8): small steps read it packed for gemv
            where it is on, else the int8 (quantized, or Q8_0's ``q8``) or nothing (bf16); int8
            quantized once."""
            q = q8 if q8 is not None else Int8Weight.quantize(t) if quant else None
            # w8a8's large steps read the int8 transposed (int8_linear), or packed for AMX
            big = q
            if q is not None and self.a8:
                big = AmxInt8Weight.pack(q.q, q.scale, swiglu) if amx else q.transposed()
            if not use_gemv:
                return big, big
            if q is None:
                return GemvWeight.pack(t, swiglu), q
            return GemvWeight.pack(q.q, swiglu, q.scale), big

        def w(name: str, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing weight {name!r}")
            t = weights[name]
            t = t[rows] if t.dim() == 1 else t[rows, cols]
            return t.to(device=device, dtype=dtype)

        H, KVH, D = tp.num_heads, tp.num_kv_heads, arch.head_dim
        self.num_heads, self.num_kv_heads = H, KVH
        self.inter = arch.intermediate_size // tp.size
        q_rows = slice(tp.q_start * D, (tp.q_start + H) * D)
        kv_rows = slice(tp.kv_start * D, (tp.kv_start + KVH) * D)
        i_rows = slice(tp.rank * self.inter, (tp.rank + 1) * self.inter)
        self.embed = w("model.embed_tokens.weight")  # [vocab, hidden], replicated
        self.final_norm = w("model.norm.weight")
        # this rank's rows of the LM head: [vocab_shard, hidden], the last rank's padded with zeros
        self.vocab_shard = -(-arch.vocab_size // tp.size)
        v_rows = slice(tp.rank * self.vocab_shard, (tp.rank + 1) * self.vocab_shard)
        self.lm_head = self.embed[v_rows] if arch.tie_word_embeddings else w("lm_head.weight", v_rows)
        if self.lm_head.shape[0] < self.vocab_shard:
            pad = self.lm_head.new_zeros(self.vocab_shard - self.lm_head.shape[0], self.lm_head.shape[1])
            self.lm_head = torch.cat([self.lm_head, pad])
        # w8a16 from Q8_0: each layer's four matrices in the file's blocks, all layers or none (the
        # fused step takes one kind of scale for every layer)
        blocks = q8_0 if quantization == W8A16 and q8_0 else {}
        all_cols = slice(None)

        def layer_q8(i: int) -> tuple[Int8Weight | None, ...]:
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            return (q8_0_matrix(blocks, [(a + "q_proj.weight", q_rows, all_cols),
                                         (a + "k_proj.weight", kv_rows, all_cols),
                                         (a + "v_proj.weight", kv_rows, all_cols)]),
                    q8_0_matrix(blocks, [(a + "o_proj.weight", all_cols, q_rows)]),
                    q8_0_matrix(blocks, [(p + "mlp.gate_proj.weight", i_rows, all_cols),
                                         (p + "mlp.up_proj.weight", i_rows, all_cols)]),
                    q8_0_matrix(blocks, [(p + "mlp.down_proj.weight", all_cols, i_rows)]))

        q8_layers = [layer_q8(i) for i in range(arch.num_layers)] if blocks else []
        if not q8_layers or not all(m is not None for layer in q8_layers for m in layer):
            q8_layers = [(None,) * 4] * arch.num_layers
        self.q8_0 = bool(blocks) and q8_layers[0][0] is not None  # the layers keep Q8_0's blocks
        self.layers: list[_Layer] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_b = None
            if arch.attention_bias:
                qkv_b = torch.cat([w(a + "q_proj.bias", q_rows), w(a + "k_proj.bias", kv_rows),
                                   w(a + "v_proj.bias", kv_rows)])
            qk_norm = None
            if arch.qk_norm:
                qk_norm = torch.cat([w(a + "q_norm.weight").expand(H, D), w(a + "k_norm.weight").expand(KVH, D)])
            qkv_w = torch.cat([w(a + "q_proj.weight", q_rows), w(a + "k_proj.weight", kv_rows),
                               w(a + "v_proj.weight", kv_rows)])
            o_w = w(a + "o_proj.weight", slice(None), q_rows)
            down_w = w(p + "mlp.down_proj.weight", slice(None), i_rows)
            gate_up_w = torch.cat([w(p + "mlp.gate_proj.weight", i_rows), w(p + "mlp.up_proj.weight", i_rows)])
            qkv_q8, o_q8, gate_up_q8, down_q8 = q8_layers[i]
            (qkv_g, qkv_8), (o_g, o_8) = forms(qkv_w, q8=qkv_q8), forms(o_w, q8=o_q8)
            (gate_up_g, gate_up_8), (down_g, down_8) = (forms(gate_up_w, swiglu=True, q8=gate_up_q8),
                                                        forms(down_w, q8=down_q8))
            layer = _Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv_w=qkv_w,
                qkv_b=qkv_b,
                qk_norm=qk_norm,
                o_w=o_w,
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up_w=gate_up_w,
                down_w=down_w,
                qkv_g=qkv_g,
                o_g=o_g,
                gate_up_g=gate_up_g,
                down_g=down_g,
            )
            if self.a8:  # int8 products read the row-major int8 (the same values as the packed copy)
                layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w = qkv_8, o_8, gate_up_8, down_8
            elif quant:  # one int8 copy serves both paths
                layer.qkv_w, layer.o_w = layer.qkv_g, layer.o_g
                layer.gate_up_w, layer.down_w = layer.gate_up_g, layer.down_g
            elif self.gemm:
                layer.qkv_w, layer.o_w = PanelWeight.pack(qkv_w), PanelWeight.pack(o_w)
                layer.gate_up_w, layer.down_w = PanelWeight.pack(gate_up_w, swiglu=True), PanelWeight.pack(down_w)
            elif packed:
                layer.qkv_w, layer.o_w, layer.down_w = _pack(qkv_w), _pack(o_w), _pack(down_w)
                layer.gate_w = _pack(gate_up_w[: self.inter])
                layer.up_w = _pack(gate_up_w[self.inter :])
                layer.gate_up_w = None
            self.layers.append(layer)
        head_name = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        self.lm_head_g, _ = forms(self.lm_head, q8=q8_0_matrix(blocks, [(head_name, v_rows, all_cols)],
                                                                rows=self.vocab_shard))
        # an int8 head that gemv multiplies in place (INT8_HEAD_GEMV_ROWS)
        self.int8_head_gemv = quant and self.gemv_rows > 0
        if quant:
            self.lm_head = self.lm_head_g
        elif self.gemm:
            self.lm_head = PanelWeight.pack(self.lm_head)
        elif packed:
            self.lm_head = _pack(self.lm_head)
        # rope tables as transformers builds them: float32 angles, cast to the model dtype
        positions = torch.arange(arch.max_context_len, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(arch))  # [ctx, D / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [ctx, D]
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend,
                after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] float32; ``attn.begin_forward(batch)`` already ran.
        ``after_layer(i)``: called once layer i's attention stored its K and V (layer-wise KV send)."""
        arch = self.arch
        H, KVH, D, eps = self.num_heads, self.num_kv_heads, arch.head_dim, arch.rms_norm_eps
        inter = self.inter
        # the residual add is fused into o and down only where no all-reduce sits between them
        fuse_residual = self.tp.size == 1
        qk_end = (H + KVH) * D
        T = batch.input_ids.shape[0]
        h = F.embedding(batch.input_ids, self.embed)  # [T, hidden]
        if T <= self.fused_rows and 0 < batch.logits_indices.numel() <= self.fused_rows:
            pages = attn.native_decode_pages()
            if pages is not None:
                return self._fused_decode(h, batch, attn, pages, after_layer)
        native = self.native
        norm = (lambda x, w: native.rms_norm(x, w, eps)) if native is not None else (lambda x, w: _rms_norm(x, w, eps))
        if native is None:
            cos = self.cos.index_select(0, batch.positions)[:, None, :]  # [T, 1, D]
            sin = self.sin.index_select(0, batch.positions)[:, None, :]
        half = D // 2
        # a small step: every linear through native gemv (the whole step, so one path per step);
        # a larger bf16 one through the native panel products where the model packed them
        small = T <= self.gemv_rows
        w8_amx = self.w8_amx and T <= W8_AMX_MAX_ROWS and (not self.a8 or batch.is_decode)
        mm = native.gemv if small else native.gemm if self.gemm else native.w8_amx_linear if w8_amx else None
        packed = self.packed and mm is None  # oneDNN's prepacked linears
        a8 = self.a8 and not small and not w8_amx
        ia = self.int8_act
        lp = torch.ops.mkldnn._linear_pointwise if packed else None
        dtype = self.dtype

        gemv = native.gemv if self.gemv_rows else None  # small steps, and an int8 head at any step
        upcast = self.upcast

        def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
            """The plain path's linear: in the model dtype, or in float32 where bf16 is upcast."""
            if upcast:
                b = None if bias is None else bias.float()
                return F.linear(x.float(), dense(w, torch.float32), b).to(dtype)
            return F.linear(x, dense(w, dtype), bias)

        last = len(self.layers) - 1
        # the weights mm reads: packed for gemv (its steps and w8_amx_linear's), or in panels
        gemv_form = small or w8_amx
        for i, layer in enumerate(self.layers):
            qkv_m, o_m, gate_up_m, down_m = ((layer.qkv_g, layer.o_g, layer.gate_up_g, layer.down_g) if gemv_form
                                             else (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w))
            x = norm(h, layer.input_norm)
            if small:
                qkv = gemv(x, qkv_m)
                qkv = qkv if layer.qkv_b is None else qkv + layer.qkv_b
            elif mm is not None:
                qkv = mm(x, qkv_m, bias=layer.qkv_b)  # one rounding, as oneDNN's
            elif packed:
                qkv = lp(x, layer.qkv_w, layer.qkv_b, "none", [], "")
            elif a8:
                qkv = int8_linear(x, layer.qkv_w, ia)
                qkv = qkv if layer.qkv_b is None else qkv + layer.qkv_b
            else:
                qkv = linear(x, layer.qkv_w, layer.qkv_b)  # [T, (H + 2 KVH) * D]
            qk = qkv[:, :qk_end].view(T, H + KVH, D)
            if layer.qk_norm is not None:
                qk = _rms_norm(qk, layer.qk_norm, eps)
            # rotate_half rope on q and k together: x * cos + [-x2, x1] * sin
            if native is not None:
                qk = native.rope(qk, self.cos, self.sin, batch.positions)  # [T, H + KVH, D]
            else:
                qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
            v = qkv[:, qk_end:].view(T, KVH, D)
            o = attn.forward(qk[:, :H], qk[:, H:], v, i)  # [T, H * D]
            if after_layer is not None:  # off: one test per layer
                after_layer(i)
            if i == last:
                # past the last attention only the sampled rows matter
                if batch.logits_indices.numel() == 0:  # a middle chunk of a chunked prefill
                    return torch.empty(0, arch.vocab_size, dtype=torch.float32, device=self.device)
                o = o.index_select(0, batch.logits_indices)  # [num_sampled, H * D]
                h = h.index_select(0, batch.logits_indices)
            if mm is not None and fuse_residual:
                h = mm(o, o_m, residual=h)  # h + o @ o_w.T, one rounding as oneDNN's post-op
                x = norm(h, layer.post_norm)
                h = mm(mm(x, gate_up_m), down_m, residual=h)  # gate_up_m: SwiGLU
            elif mm is not None:
                h = h + all_reduce(mm(o, o_m))
                x = norm(h, layer.post_norm)
                h = h + all_reduce(mm(mm(x, gate_up_m), down_m))
            elif packed and fuse_residual:
                h = lp.binary(o, h, layer.o_w, None, "add")  # h + o @ o_w.T
                x = norm(h, layer.post_norm)
                act = lp.binary(x, lp(x, layer.gate_w, None, "swish", [], ""), layer.up_w, None, "mul")
                h = lp.binary(act, h, layer.down_w, None, "add")
            elif a8 and fuse_residual:
                h = int8_linear(o, layer.o_w, ia, residual=h)
                x = norm(h, layer.post_norm)
                h = int8_linear(int8_linear(x, layer.gate_up_w, ia, swiglu=True), layer.down_w, ia, residual=h)
            elif a8:
                h = h + all_reduce(int8_linear(o, layer.o_w, ia))
                x = norm(h, layer.post_norm)
                h = h + all_reduce(int8_linear(int8_linear(x, layer.gate_up_w, ia, swiglu=True), layer.down_w, ia))
            elif packed:
                h = h + all_reduce(lp(o, layer.o_w, None, "none", [], ""))
                x = norm(h, layer.post_norm)
                act = lp.binary(x, lp(x, layer.gate_w, None, "swish", [], ""), layer.up_w, None, "mul")
                h = h + all_reduce(lp(act, layer.down_w, None, "none", [], ""))
            else:
                h = h + all_reduce(linear(o, layer.o_w))  # TP 1: no collective
                x = norm(h, layer.post_norm)
                gu = linear(x, layer.gate_up_w)  # [T, 2 * inter]
                h = h + all_reduce(linear(F.silu(gu[:, :inter]) * gu[:, inter:], layer.down_w))
        # h: [num_sampled, hidden]
        x = norm(h, self.final_norm)
        rows = x.shape[0]
        if small or (self.int8_head_gemv and rows <= (W8_AMX_HEAD_MIN_ROWS if self.w8_amx else INT8_HEAD_GEMV_ROWS)):
            logits = gemv(x, self.lm_head_g)
        elif self.w8_amx:
            logits = native.w8_amx_linear(x, self.lm_head_g, out_dtype=torch.float32)
        elif self.gemm:
            logits = native.gemm(x, self.lm_head, out_dtype=torch.float32)  # no widening pass after
        elif packed:
            logits = lp(x, self.lm_head, None, "none", [], "")
        else:
            logits = linear(x, self.lm_head)
        return self._full_logits(logits)

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        # [num_sampled, vocab_shard] per rank -> the whole vocabulary on every rank, for identical sampling
        logits = all_gather_last_dim(logits.float())
        vocab = self.arch.vocab_size
        return logits[:, :vocab] if logits.shape[1] != vocab else logits

    def _fused_decode(self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                      pages: tuple[torch.Tensor, torch.Tensor],
                      after_layer: Callable[[int], None] | None) -> torch.Tensor:
        """``forward`` of an all-decode step through one DecodeStack call (one per layer with
        ``after_layer``, called once the layer, K/V store included, is done). h: [T, hidden]."""
        stack = self._decode_stack(attn)
        page_table, seq_lens = pages
        sel = batch.logits_indices.contiguous()
        logits = torch.empty(sel.numel(), stack.vocab, dtype=stack.logits_dtype(h.shape[0]))
        step = (h, batch.positions.contiguous(), batch.out_cache_loc.contiguous(), page_table, seq_lens)
        last = len(self.layers)
        if after_layer is None:
            stack.run(*step, 0, last, sel, logits)
        else:
            for i in range(last):
                stack.run(*step, i, i + 1, sel, logits if i == last - 1 else None)
                after_layer(i)
        return self._full_logits(logits)

    def _decode_stack(self, attn: AttentionBackend) -> DecodeStack:
        """The DecodeStack over this model's gemv weights and ``attn``'s page pool (rebuilt when the
        pool's tensors change)."""
        pool = attn.page_pool
        key = (id(pool), pool.k[0].data_ptr())
        if self.decode_stack is not None and self._stack_pool == key:
            return self.decode_stack
        slot_stride, head_stride, dim_stride = pool.k_slots(0).stride()
        assert dim_stride == 1 and pool.v_slots(0).stride() == (slot_stride, head_stride, 1)

        layers = [DecodeLayerTensors(layer.input_norm, layer.qkv_g, layer.qkv_b, layer.o_g, layer.post_norm,
                                     layer.gate_up_g, layer.down_g, pool.k[i], pool.v[i],
                                     (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w) if self.gemm else None)
                  for i, layer in enumerate(self.layers)]
        arch = self.arch
        shape = DecodeShape(self.num_heads, self.num_kv_heads, arch.head_dim, pool.page_size, arch.rms_norm_eps,
                            attn.scale, slot_stride, head_stride)
        stack = DecodeStack(self.native, shape, layers, self.final_norm, self.lm_head_g, self.cos, self.sin,
                            self.gemv_rows, self.lm_head if self.gemm else None)
        self.decode_stack, self._stack_pool = stack, key
        return stack
