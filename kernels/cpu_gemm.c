/* bf16 matrix products for every step larger than gemv's: out[M, N] = x[M, K] @ W[N, K]^T,
   W packed in panels of 64 rows as gemm_layout.py describes (PanelWeight). Built by
   cpu_native.py.

   Why not oneDNN's prepacked linear, which ran these before: a decode step of 64 sequences
   streams the model's 270 MB of weights once through 151 products of 64 rows, each too short
   for oneDNN to hide the weights' trip from memory behind its arithmetic. Cold (the weights
   evicted, as in a step) its products ran the default model's shapes at 240-380 GFLOP/s on two
   Zen 4 cores against 390-430 in cache. This loop streams each panel once, sequentially, while
   the dot products run: the same shapes cold at 365-412 GFLOP/s, the step's products 1.12-1.18x
   oneDNN's (43.5 ms against 48.7), 1.32x at 16 rows, 1.01-1.06x at 256, 0.97-0.99x at 1024 and
   4096 (prefill sizes; the LM head's 49152 rows there 0.85x, which a prefill runs only on its
   sampled rows) (scripts/bench_gemm.py, results/bench_gemm/).

   The micro-kernel holds MR x rows' sums for one panel's 64 output columns in 4 x MR registers:
   per pair of columns of x it loads the panel's 64 weight pairs (4 vectors) once and broadcasts
   each x row's pair against them (vdpbf16ps, float32 sums of bf16 pairs, in column order). x is
   taken in blocks of rows that stay in L2 (``MC_BYTES``); within a block a panel is read once per
   MR rows, from L1/L2 after its first pass. Panels are split across OpenMP threads, and each
   panel's rows in two halves where there are too few panels to share evenly.

   Epilogues (``mode``), rounding once to bf16 as oneDNN's post-ops do (``bias``, where given,
   is added to acc first: q|k|v's bias):
     0: out = bf16(acc)
     1: out = bf16(acc + res)                   the residual add fused into o and down
     2: W is gate | up packed as SwiGLU (each panel 32 gate rows, then the same 32 up rows) and
        out is [M, N / 2]: out = bf16(acc_up * bf16(silu(acc_gate)))
   ``out_f32``: out is float32 holding the bf16-rounded values (the LM head's logits, which
   sampling reads as float32: no separate widening pass).
   Returns 0, or -1 where the CPU lacks AVX-512 BF16, or has AMX, whose oneDNN kernels are the
   faster path (``gemm_supported``; there the model keeps oneDNN's prepacked linears). */
#include <stdint.h>
#include <math.h>
#include <omp.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#include <immintrin.h>
#include "cpu_bf16_avx512.h"
#define GEMM_OK 1
#else
#define GEMM_OK 0
#endif

int gemm_supported(void) { return GEMM_OK; }

#if GEMM_OK

#define NB 64            /* W rows per panel (gemm_layout.PANEL) */
#define HALF 32          /* a SwiGLU panel's gate rows (then as many up rows) */
#define MR 6             /* x rows per micro-kernel pass: 24 accumulators + 4 weights + 1 broadcast */
#define MC_BYTES (384 * 1024)  /* x rows per block: their bytes stay in L2 */

/* silu(g) = g * sigmoid(g), sigmoid from exp(-|g|) (exp_nonpos, vectorized by the compiler) */
static inline void silu_rows(float* g, int n) {
    for (int i = 0; i < n; i++) {
        const float e = exp_nonpos(-fabsf(g[i]));
        const float s = g[i] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
        g[i] = g[i] * s;
    }
}

typedef struct {
    const uint16_t* x;
    int64_t xs;
    void* out;
    int64_t os;
    const uint16_t* res;
    int64_t rs;
    const uint16_t* bias;
    int64_t K;
    int mode, out_f32;
} gemm_args;

/* one column pair of MRR rows against a panel's 4 weight vectors w (its 64 rows' pairs) */
static inline __attribute__((always_inline)) void pair_step(__m512 acc[MR][4], const uint16_t* w, const uint32_t* xp[MR],
                                                            int64_t kp, const int MRR) {
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 32),
                  w2 = _mm512_loadu_si512(w + 64), w3 = _mm512_loadu_si512(w + 96);
    for (int m = 0; m < MRR; m++) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32((int)xp[m][kp]);
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)w0, b);
        acc[m][1] = _mm512_dpbf16_ps(acc[m][1], (__m512bh)w1, b);
        acc[m][2] = _mm512_dpbf16_ps(acc[m][2], (__m512bh)w2, b);
        acc[m][3] = _mm512_dpbf16_ps(acc[m][3], (__m512bh)w3, b);
    }
}

/* rows m0..m0+MRR-1 of x against one panel P ([K/2][64][2] bf16); its output columns start at
   n0 (for SwiGLU: n0 is the panel's first gate row, also its first output column) and ``valid``
   of its 64 (32 for SwiGLU) are real. Always inlined with a literal MRR. */
static inline __attribute__((always_inline)) void micro(const gemm_args* a, const uint16_t* P, int m0,
                                                        const int MRR, int n0, int valid) {
    __m512 acc[MR][4];
    for (int m = 0; m < MRR; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
    const uint32_t* xr[MR];
    for (int m = 0; m < MRR; m++) xr[m] = (const uint32_t*)(a->x + (int64_t)(m0 + m) * a->xs);
    const int64_t pairs = a->K / 2;
    for (int64_t kp = 0; kp < pairs; kp++) pair_step(acc, P + kp * NB * 2, xr, kp, MRR);
    if (a->K & 1) {  /* the last column alone (x's pair: it and a zero; the weights' second is zero too) */
        uint32_t last[MR];
        const uint32_t* lp[MR];
        for (int m = 0; m < MRR; m++) {
            last[m] = a->x[(int64_t)(m0 + m) * a->xs + a->K - 1];
            lp[m] = last + m;
        }
        pair_step(acc, P + pairs * NB * 2, lp, 0, MRR);
    }
    for (int m = 0; m < MRR; m++) {
        const int64_t row = (int64_t)(m0 + m) * a->os + n0;
        if (a->mode == 2) {
            float g[HALF];
            _mm512_storeu_ps(g, acc[m][0]);
            _mm512_storeu_ps(g + 16, acc[m][1]);
            silu_rows(g, HALF);
            for (int j = 0; j < 2 && 16 * j < valid; j++) {
                const __m512 gate = widen_bf16(round_bf16(_mm512_loadu_ps(g + 16 * j)));
                store16(a->out, row + 16 * j, _mm512_mul_ps(acc[m][2 + j], gate), valid - 16 * j, a->out_f32);
            }
            continue;
        }
        for (int j = 0; j < 4 && 16 * j < valid; j++) {
            __m512 v = acc[m][j];
            const __mmask16 mask = lanes16(valid - 16 * j);
            if (a->bias) v = _mm512_add_ps(v, widen_bf16(_mm256_maskz_loadu_epi16(mask, a->bias + n0 + 16 * j)));
            if (a->mode == 1) {
                const __m256i r = _mm256_maskz_loadu_epi16(mask, a->res + (int64_t)(m0 + m) * a->rs + n0 + 16 * j);
                v = _mm512_add_ps(v, widen_bf16(r));
            }
            store16(a->out, row + 16 * j, v, valid - 16 * j, a->out_f32);
        }
    }
}

/* rows m0..m1-1 of x against panel p, MR rows at a time */
static void panel_rows(const gemm_args* a, const uint16_t* W, int64_t p, int N, int m0, int m1) {
    const int64_t pairs = (a->K + 1) / 2;
    const uint16_t* P = W + p * pairs * NB * 2;
    const int width = a->mode == 2 ? HALF : NB;  /* output columns per panel */
    const int n0 = (int)p * width;
    const int out_cols = a->mode == 2 ? N / 2 : N;
    const int valid = out_cols - n0 < width ? out_cols - n0 : width;
    for (int m = m0; m < m1; m += MR) {
        switch (m1 - m < MR ? m1 - m : MR) {
#define ROWS_CASE(R) case R: micro(a, P, m, R, n0, valid); break;
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#undef ROWS_CASE
        }
    }
}

#endif

/* x: [M, K] bf16 rows at x_stride; W: [N, K] packed (PanelWeight; as SwiGLU for mode 2);
   out: [M, N or N / 2] rows at out_stride, bf16 or (out_f32) float32; res: [M, N] bf16 rows at
   res_stride (mode 1 only); bias: [N] bf16 or null (not with mode 2) */
int gemm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* W, void* out, int64_t out_stride,
              const uint16_t* res, int64_t res_stride, const uint16_t* bias, int M, int N, int K, int mode,
              int out_f32) {
#if GEMM_OK
    if (bias && mode == 2) return -2;
    const gemm_args a = {x, x_stride, out, out_stride, res, res_stride, bias, K, mode, out_f32};
    const int64_t panels = mode == 2 ? (N / 2 + HALF - 1) / HALF : (N + NB - 1) / NB;
    int mc = (int)(MC_BYTES / (2 * (int64_t)K)) / MR * MR;
    mc = mc < MR ? MR : mc;
    const int threads = omp_get_max_threads();
    for (int b0 = 0; b0 < M; b0 += mc) {
        const int b1 = M - b0 < mc ? M : b0 + mc;
        const int mblocks = (b1 - b0 + MR - 1) / MR;
        /* too few panels to share evenly: each panel's rows in two halves */
        const int splits = panels >= 8 * threads || mblocks < 2 ? 1 : 2;
        const int per = (mblocks + splits - 1) / splits * MR;
        #pragma omp parallel for schedule(static)
        for (int64_t it = 0; it < panels * splits; it++) {
            const int part = (int)(it % splits);
            const int m0 = b0 + part * per, m1 = b0 + (part + 1) * per < b1 ? b0 + (part + 1) * per : b1;
            if (m0 < m1) panel_rows(&a, W, it / splits, N, m0, m1);
        }
    }
    return 0;
#else
    return -1;
#endif
}
