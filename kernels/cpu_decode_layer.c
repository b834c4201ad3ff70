/* A small decode step's layers in one native call, built by cpu_native.py.

   Why: at one to four tokens a decode step of the default model (30 layers) is a stream over
   ~270 MB of weights, floor ~7.7 ms on this CPU, yet it took ~21 ms through native gemv with
   every op called from Python: ~240 ctypes calls and ~15 torch ops per layer, each a few
   microseconds of dispatch plus a fresh tensor. Here one call runs a range of layers (the whole
   stack, then the final norm and the LM head) by calling the same C kernels in the same order
   on preallocated scratch, so its outputs are bit-identical to the per-op path:

     x = rms_norm(h); qkv = x @ Wqkv^T (+ bias); qk = rope(qkv[q | k]);
     store k, v at the step's slots; o = decode_attention(q over the pages);
     h = h + o @ Wo^T (one rounding); x = rms_norm(h); a = silu(x @ Wg^T) * (x @ Wu^T);
     h = h + a @ Wd^T

   The K/V store (cpu_kv_store.c's, as the per-op path's) takes the pool's strides (a slot's and a head's, in elements) from the caller,
   so it holds for any layout of the per-layer pool tensors; decode attention is called through
   the pointer cpu_native.py chose for it, with the arguments cpu_native.py passes it.
   Tensor parallel (an all-reduce after o and after down) is left to the per-op path.

   Larger decode steps (more than ``gemv_rows`` sequences) take the same call where the model
   holds its bf16 weights in panels (cpu_gemm.c): each product then goes through gemm_bf16, as
   the per-op path's do, q|k|v's bias fused into its rounding, the LM head writing float32
   logits. At 64 sequences the per-op path spent ~3.5 ms of a 57 ms step in its ~300 calls from
   Python (norms, rope, K/V store and attention wrappers, fresh tensors).

   Under LoRA (--enable-lora) the same call adds each row's adapter delta (cpu_lora.c's segmented
   product) to each of the four products that has adapters, where the step names the rows' slots:
   into q|k|v after its bias, into the residual stream after o and after down (h + o Wo, then the
   delta), and into gate|up before SiLU: a LoRA model keeps gate|up unpacked (``gate_up_plain``),
   so that product writes gate | up and SwiGLU follows here, as torch's per-op path takes it. */
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"
#include "cpu_lora.h"

/* the kernels this file calls, defined in cpu_gemv.c and cpu_norm_rope.c */
int gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* W, uint16_t* out, int64_t out_stride,
              const uint16_t* res, int64_t res_stride, int M, int N, int K, int mode);
int gemv_w8_bf16(const uint16_t* x, int64_t x_stride, const int8_t* W, const float* scale, int blocked,
                 uint16_t* out, int64_t out_stride, const uint16_t* res, int64_t res_stride, int M, int N, int K,
                 int mode);
int rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, uint16_t* out, int64_t out_stride,
                  int T, int N, float eps);
int rope_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* cos_t, const uint16_t* sin_t,
              const int64_t* pos, uint16_t* out, int T, int NH, int D);
/* cpu_kv_store.c (strides in bytes) */
int kv_store(const uint8_t* k, int64_t k_tok_stride, int64_t k_head_stride, const uint8_t* v, int64_t v_tok_stride,
             int64_t v_head_stride, uint8_t* k_cache, uint8_t* v_cache, int64_t slot_stride, int64_t cache_head_stride,
             const int64_t* loc, int T, int heads, int64_t row_bytes);
/* cpu_gemm.c */
int gemm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* W, void* out, int64_t out_stride,
              const uint16_t* res, int64_t res_stride, const uint16_t* bias, int M, int N, int K, int mode,
              int out_f32);
/* decode_attn_bf16* in cpu_decode_attn.c */
typedef int (*decode_attn_fn)(const uint16_t* q, int64_t q_stride, const uint16_t* k_cache, const uint16_t* v_cache,
                              int64_t head_stride, int64_t page_stride, int64_t tok_stride,
                              const int32_t* page_table, int64_t pt_stride, const int32_t* seq_lens, uint16_t* out,
                              int n, int H, int KVH, int D, int ps, float scale);

/* One layer's tensors (mirrored by cpu_native.DecodeLayerDesc). Weights are packed for gemv
   (gemv_layout.py; gate_up as SwiGLU), bf16, or int8 with float32 per-row scales (then the
   *_scale pointers are set). */
typedef struct {
    const uint16_t* input_norm;  /* [hidden] */
    const void* qkv_w;           /* [(H + 2 KVH) D, hidden] */
    const float* qkv_scale;
    const uint16_t* qkv_bias;    /* [(H + 2 KVH) D] or NULL */
    const void* o_w;             /* [hidden, H D] */
    const float* o_scale;
    const uint16_t* post_norm;   /* [hidden] */
    const void* gate_up_w;       /* [2 inter, hidden]: gate | up, packed as SwiGLU */
    const float* gate_up_scale;
    const void* down_w;          /* [hidden, inter] */
    const float* down_scale;
    uint16_t* k_cache;           /* the pool's per-layer tensors, as decode attention takes them */
    uint16_t* v_cache;
    /* the same four packed in panels (gemm_layout.py), or all NULL: the steps past gemv_rows */
    const uint16_t *qkv_p, *o_p, *gate_up_p, *down_p;
    /* the LoRA adapters of q|k|v, o, gate|up and down (cpu_lora.h), or NULL where none */
    const lora_weights *lora_qkv, *lora_o, *lora_gate_up, *lora_down;
} decode_layer_desc;

/* The model and its scratch (mirrored by cpu_native.DecodeModelDesc). Scratch buffers hold
   max_rows rows each: x [hidden], qkv [(H + 2 KVH) D], qk [(H + KVH) D], attn [H D] and
   attn_sel [H D], act [inter], h_sel [hidden]. */
typedef struct {
    const decode_layer_desc* layers;
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab, int8, page_size;
    int64_t kv_slot_stride, kv_head_stride;  /* elements between two slots, two heads of a K/V tensor */
    const uint16_t* cos;  /* [ctx, D] */
    const uint16_t* sin;
    const uint16_t* final_norm;  /* [hidden] */
    const void* lm_head;  /* [vocab, hidden] */
    const float* lm_head_scale;
    void* attn;  /* decode_attn_fn */
    uint16_t *x, *qkv, *qk, *attn_out, *attn_sel, *act, *h_sel;
    int64_t max_rows;
    const uint16_t* lm_head_p;  /* [vocab, hidden] in panels, or NULL */
    int64_t gemv_rows;          /* steps of more rows take the panels */
    int64_t blocked, head_blocked;  /* int8 scales per 32-column chunk (Q8_0): the layers', the LM head's */
    float eps, scale;
    int64_t gate_up_plain;  /* gate_up packed plain (not as SwiGLU): its product writes gu, SwiGLU follows */
    uint16_t* gu;           /* [max_rows, 2 inter] where gate_up_plain */
    int32_t* sel_slot;      /* [max_rows]: the sampled rows' LoRA slots past the last attention */
} decode_model_desc;

/* out = x @ W^T through the epilogue ``mode``: gemm over the panels P where the step (``big``)
   is past gemv's rows (then ``bias`` is added before the rounding and ``out_f32`` writes
   float32), else gemv over w (its caller adds any bias) */
static int linear(const decode_model_desc* m, int big, const uint16_t* x, int64_t x_stride, const void* w,
                  const float* s, const uint16_t* P, const uint16_t* bias, void* out, int64_t out_stride,
                  const uint16_t* res, int64_t res_stride, int M, int N, int K, int mode, int out_f32, int blocked) {
    if (big)
        return gemm_bf16(x, x_stride, P, out, out_stride, res, res_stride, bias, M, N, K, mode, out_f32);
    if (m->int8)
        return gemv_w8_bf16(x, x_stride, (const int8_t*)w, s, blocked, out, out_stride, res, res_stride, M, N, K, mode);
    return gemv_bf16(x, x_stride, (const uint16_t*)w, (uint16_t*)out, out_stride, res, res_stride, M, N, K, mode);
}

/* Layers [first, last) of one decode step over M rows (one token of each of M sequences).
   h: [M, hidden] bf16 contiguous, the residual stream, updated in place; pos, loc: [M] int64
   positions and slots; page_table: [M, pt_stride] int32; seq_lens: [M] int32. Where the range
   ends at the last layer, the rows ``sel`` [nsel] of its attention output and residual go on
   (the sampled rows), then the final norm and the LM head write ``logits`` [nsel, vocab]: bf16,
   float32 in a step past gemv's rows. row_slot [M]: each row's LoRA slot (-1: none), or NULL
   where no row uses an adapter. Returns 0, or the first failing kernel's code. */
int decode_layers_bf16(const decode_model_desc* m, uint16_t* h, int M, const int64_t* pos, const int64_t* loc,
                       const int32_t* page_table, int64_t pt_stride, const int32_t* seq_lens, int first, int last,
                       const int64_t* sel, int nsel, void* logits, const int32_t* row_slot) {
    if (M < 1 || M > m->max_rows || nsel < 0 || nsel > m->max_rows || first < 0 || last > m->num_layers)
        return -10;
    /* the step's size picks the products for all its layers, as the per-op path's does */
    const int big = M > m->gemv_rows;
    if (big && !m->lm_head_p) return -11;
    const int64_t hidden = m->hidden, H = m->num_heads, KVH = m->num_kv_heads, D = m->head_dim, inter = m->inter;
    const int64_t qkv_n = (H + 2 * KVH) * D, qk_n = (H + KVH) * D, hd = H * D;
    const decode_attn_fn attn = (decode_attn_fn)m->attn;
    int rc = 0;
    for (int i = first; i < last; i++) {
        const decode_layer_desc* l = &m->layers[i];
        if (big && !(l->qkv_p && l->o_p && l->gate_up_p && l->down_p)) return -11;
        rc = rms_norm_bf16(h, hidden, l->input_norm, m->x, hidden, M, (int)hidden, m->eps);
        if (!rc) rc = linear(m, big, m->x, hidden, l->qkv_w, l->qkv_scale, l->qkv_p, l->qkv_bias, m->qkv, qkv_n, 0, 0,
                             M, (int)qkv_n, (int)hidden, 0, 0, (int)m->blocked);
        if (rc) return rc;
        if (l->qkv_bias && !big)  /* as torch adds bf16: in float32, rounded once */
            for (int64_t t = 0; t < M; t++)
                for (int64_t n = 0; n < qkv_n; n++)
                    m->qkv[t * qkv_n + n] = f32_to_bf16(bf16_to_f32(m->qkv[t * qkv_n + n]) + bf16_to_f32(l->qkv_bias[n]));
        if (row_slot && l->lora_qkv && (rc = lora_add_bf16(l->lora_qkv, m->x, hidden, m->qkv, qkv_n, row_slot, M)))
            return rc;
        rope_bf16(m->qkv, qkv_n, m->cos, m->sin, pos, m->qk, M, (int)(H + KVH), (int)D);
        {  /* the new K (rope'd, in qk) and V (in qkv) of every row at its slot */
            const int64_t e = sizeof(uint16_t);
            kv_store((const uint8_t*)(m->qk + hd), qk_n * e, D * e, (const uint8_t*)(m->qkv + qk_n), qkv_n * e, D * e,
                     (uint8_t*)l->k_cache, (uint8_t*)l->v_cache, m->kv_slot_stride * e, m->kv_head_stride * e, loc, M,
                     (int)KVH, D * e);
        }
        /* a slot's K/V at slot * kv_slot_stride: a page of them at page_size times that */
        rc = attn(m->qk, qk_n, l->k_cache, l->v_cache, m->kv_head_stride, m->page_size * m->kv_slot_stride,
                  m->kv_slot_stride, page_table, pt_stride, seq_lens, m->attn_out, M, (int)H,
                  (int)KVH, (int)D, (int)m->page_size, m->scale);
        if (rc) return rc;
        uint16_t* o = m->attn_out;
        if (i == m->num_layers - 1) {  /* past the last attention only the sampled rows matter */
            for (int j = 0; j < nsel; j++) {
                memcpy(m->attn_sel + j * hd, m->attn_out + sel[j] * hd, (size_t)hd * sizeof(uint16_t));
                memcpy(m->h_sel + j * hidden, h + sel[j] * hidden, (size_t)hidden * sizeof(uint16_t));
            }
            o = m->attn_sel;
            h = m->h_sel;
            if (row_slot) {
                for (int j = 0; j < nsel; j++) m->sel_slot[j] = row_slot[sel[j]];
                row_slot = m->sel_slot;
            }
            M = nsel;
            if (M == 0) return 0;
        }
        rc = linear(m, big, o, hd, l->o_w, l->o_scale, l->o_p, 0, h, hidden, h, hidden, M, (int)hidden, (int)hd, 1, 0,
                    (int)m->blocked);
        if (!rc && row_slot && l->lora_o) rc = lora_add_bf16(l->lora_o, o, hd, h, hidden, row_slot, M);
        if (!rc) rc = rms_norm_bf16(h, hidden, l->post_norm, m->x, hidden, M, (int)hidden, m->eps);
        if (rc) return rc;
        if (m->gate_up_plain) {  /* gate | up, its delta, then SwiGLU rounded as torch's silu and product */
            rc = linear(m, big, m->x, hidden, l->gate_up_w, l->gate_up_scale, l->gate_up_p, 0, m->gu, 2 * inter, 0, 0,
                        M, (int)(2 * inter), (int)hidden, 0, 0, (int)m->blocked);
            if (!rc && row_slot && l->lora_gate_up)
                rc = lora_add_bf16(l->lora_gate_up, m->x, hidden, m->gu, 2 * inter, row_slot, M);
            if (rc) return rc;
            for (int64_t t = 0; t < M; t++) {
                const uint16_t* g = m->gu + t * 2 * inter;
                uint16_t* a = m->act + t * inter;
                for (int64_t i = 0; i < inter; i++) {
                    const float s = bf16_to_f32(f32_to_bf16(silu_nonpos_exp(bf16_to_f32(g[i]))));
                    a[i] = f32_to_bf16(s * bf16_to_f32(g[inter + i]));
                }
            }
        } else {
            rc = linear(m, big, m->x, hidden, l->gate_up_w, l->gate_up_scale, l->gate_up_p, 0, m->act, inter, 0, 0,
                        M, (int)(2 * inter), (int)hidden, 2, 0, (int)m->blocked);
        }
        if (!rc) rc = linear(m, big, m->act, inter, l->down_w, l->down_scale, l->down_p, 0, h, hidden, h, hidden, M,
                             (int)hidden, (int)inter, 1, 0, (int)m->blocked);
        if (!rc && row_slot && l->lora_down) rc = lora_add_bf16(l->lora_down, m->act, inter, h, hidden, row_slot, M);
        if (rc) return rc;
    }
    if (last == m->num_layers && logits) {
        rc = rms_norm_bf16(h, hidden, m->final_norm, m->x, hidden, M, (int)hidden, m->eps);
        if (!rc) rc = linear(m, big, m->x, hidden, m->lm_head, m->lm_head_scale, m->lm_head_p, 0, logits, m->vocab, 0,
                             0, M, (int)m->vocab, (int)hidden, 0, big, (int)m->head_blocked);
    }
    return rc;
}
