/* Skinny matrix products for the decode step: out[M, N] = x[M, K] @ W[N, K]^T with M small
   (a decode batch of a few sequences), W bf16 or int8 with per-output-channel float32 scales.
   Built by cpu_native.py.

   At M = 1 a decode step is a stream over the weights, and a product's only job is to keep
   up with memory. oneDNN's prepacked bf16 linear reads W at about 13 GB/s on one Zen 4 core
   where a plain sum over the same bytes reads 25-29 GB/s (scripts/profile_decode_step.py, lm_head_*);
   these loops stream each W row once through AVX-512 BF16 dot products (vdpbf16ps) with
   every x row held in L1, at 55-90% of the sum's rate (the LM head, one core, shared machine:
   14-24 GB/s against 26-30). torch's ``_weight_int8pack_mm`` reads
   int8 at ~6 GB/s here, so int8 gets the same loop, widening int8 to bf16 in registers.

   Rows of W are split across OpenMP threads in blocks of 4; each block runs over every x
   row (4 at a time), so W is read from memory once per call whatever M is. Sums are float32,
   rounded to bf16 once at the end as oneDNN rounds. Epilogues (``mode``), as the model's
   oneDNN post-ops do them:
     0: out = bf16(acc)
     1: out = bf16(acc + res)                      the residual add fused into o and down
     2: W is [2 I, K] = gate | up and out is [M, I]: out = bf16(acc_up * bf16(silu(acc_gate)))
   Returns 0, or -1 where the CPU lacks AVX-512 BF16 (``gemv_supported``). */
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define GEMV_OK 1
#else
#define GEMV_OK 0
#endif

int gemv_supported(void) { return GEMV_OK; }

#if GEMV_OK

#define RB 4  /* W rows per block */
#define MB 4  /* x rows per pass */

static inline float silu_f(float g) { return g / (1.f + expf(-g)); }

/* Store one block's sums acc[r][m] (output rows n0 + r of x rows m0 + m) through the epilogue. */
static inline void store_block(float acc[RB][MB], int n0, int rows, int m0, int mrows, const float* scale,
                               uint16_t* out, int64_t out_stride, const uint16_t* res, int64_t res_stride,
                               int mode, int inter, float gate[RB][MB]) {
    for (int r = 0; r < rows; r++) {
        const float s = scale ? scale[n0 + r] : 1.f;
        for (int m = 0; m < mrows; m++) {
            float v = acc[r][m] * s;
            const int64_t row = m0 + m;
            if (mode == 2) {
                /* n0 is the first up row here; its gate row is n0 - inter */
                const float g = bf16_to_f32(f32_to_bf16(silu_f(gate[r][m] * (scale ? scale[n0 + r - inter] : 1.f))));
                v = v * g;
                out[row * out_stride + (n0 - inter) + r] = f32_to_bf16(v);
            } else {
                if (mode == 1) v += bf16_to_f32(res[row * res_stride + n0 + r]);
                out[row * out_stride + n0 + r] = f32_to_bf16(v);
            }
        }
    }
}

/* Sums of W rows n0..n0+RB-1 (rows past N - 1 clamped to it, their sums unused) against x rows
   m0..m0+MR-1. Always inlined with a literal MR, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void block_bf16(const uint16_t* W, int64_t K, int N, int n0,
                                                             const uint16_t* x, int64_t x_stride, int m0,
                                                             const int MR, float acc[RB][MB]) {
    __m512 a[RB][MB];
    const uint16_t* wr[RB];
    for (int r = 0; r < RB; r++) {
        wr[r] = W + (int64_t)(n0 + r < N ? n0 + r : N - 1) * K;
        for (int m = 0; m < MR; m++) a[r][m] = _mm512_setzero_ps();
    }
    const uint16_t* xr[MB];
    for (int m = 0; m < MR; m++) xr[m] = x + (int64_t)(m0 + m) * x_stride;
    /* the next block's RB rows follow these in memory: fetch them RB cache lines per step, so the
       whole next block arrives over this one's loop. Without it the 4 short row streams defeat the
       hardware prefetcher: 3-4 GB/s instead of 24-27 (measured, one Zen 4 core, 56 MB LM head). */
    const char* next = (const char*)(W + (int64_t)(n0 + RB) * K);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int r = 0; r < RB; r++) _mm_prefetch(next + (k * RB + r * 32) * 2, _MM_HINT_T0);
        __m512i xv[MB];
        for (int m = 0; m < MR; m++) xv[m] = _mm512_loadu_si512(xr[m] + k);
        for (int r = 0; r < RB; r++) {
            const __m512i wv = _mm512_loadu_si512(wr[r] + k);
            for (int m = 0; m < MR; m++) a[r][m] = _mm512_dpbf16_ps(a[r][m], (__m512bh)wv, (__m512bh)xv[m]);
        }
    }
    if (k < K) {
        const __mmask32 mask = (__mmask32)((1u << (K - k)) - 1u);
        __m512i xv[MB];
        for (int m = 0; m < MR; m++) xv[m] = _mm512_maskz_loadu_epi16(mask, xr[m] + k);
        for (int r = 0; r < RB; r++) {
            const __m512i wv = _mm512_maskz_loadu_epi16(mask, wr[r] + k);
            for (int m = 0; m < MR; m++) a[r][m] = _mm512_dpbf16_ps(a[r][m], (__m512bh)wv, (__m512bh)xv[m]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm512_reduce_add_ps(a[r][m]);
}

/* the same for int8 W (sums unscaled): 32 weights at a time widened to bf16 (exact: |q| <= 127
   fits bf16's 8-bit significand), then the same dot products as bf16 W. Converting once per
   32 weights for all MR rows, rather than multiplying in float32 per row, keeps 4 rows at
   the bf16 kernel's speed (float32 FMAs per row: int8 at 4 rows 0.55x bf16 gemv, measured). */
static inline __attribute__((always_inline)) void block_i8(const int8_t* W, int64_t K, int N, int n0,
                                                           const uint16_t* x, int64_t x_stride, int m0,
                                                           const int MR, float acc[RB][MB]) {
    __m512 a[RB][MB];
    const int8_t* wr[RB];
    for (int r = 0; r < RB; r++) {
        wr[r] = W + (int64_t)(n0 + r < N ? n0 + r : N - 1) * K;
        for (int m = 0; m < MR; m++) a[r][m] = _mm512_setzero_ps();
    }
    const uint16_t* xr[MB];
    for (int m = 0; m < MR; m++) xr[m] = x + (int64_t)(m0 + m) * x_stride;
    const char* next = (const char*)(W + (int64_t)(n0 + RB) * K);  /* as in block_bf16 */
    for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
        _mm_prefetch(next + k * RB, _MM_HINT_T0);
        _mm_prefetch(next + k * RB + 64, _MM_HINT_T0);
        __m512i xv[MB];
        for (int m = 0; m < MR; m++) xv[m] = _mm512_maskz_loadu_epi16(mask, xr[m] + k);
        for (int r = 0; r < RB; r++) {
            const __m256i w8 = _mm256_maskz_loadu_epi8(mask, wr[r] + k);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(w8)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(w8, 1)));
            const __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);
            for (int m = 0; m < MR; m++) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, (__m512bh)xv[m]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm512_reduce_add_ps(a[r][m]);
}

/* one block for either weight type and any mrows in 1..MB, each case with a literal MR */
static void block_any(const uint16_t* Wb, const int8_t* W8, int64_t K, int N, int n0, const uint16_t* x,
                      int64_t x_stride, int m0, int mrows, float acc[RB][MB]) {
#define BLOCK_CASE(MR) case MR: \
        if (W8) block_i8(W8, K, N, n0, x, x_stride, m0, MR, acc); else block_bf16(Wb, K, N, n0, x, x_stride, m0, MR, acc); \
        break;
    switch (mrows) { BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4) }
#undef BLOCK_CASE
}

/* One driver for both weight types: ``W8`` non-null selects int8 (with ``scale``). */
static int gemv_run(const uint16_t* x, int64_t x_stride, const uint16_t* Wb, const int8_t* W8, const float* scale,
                    uint16_t* out, int64_t out_stride, const uint16_t* res, int64_t res_stride,
                    int M, int N, int K, int mode) {
    /* mode 2: blocks over the I = N / 2 gate rows; each also computes the matching up rows */
    const int rows_out = mode == 2 ? N / 2 : N;
    const int nblocks = (rows_out + RB - 1) / RB;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        const int n0 = b * RB;
        const int rows = rows_out - n0 < RB ? rows_out - n0 : RB;
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mrows = M - m0 < MB ? M - m0 : MB;
            float acc[RB][MB], gate[RB][MB];
            if (mode == 2) {
                block_any(Wb, W8, K, N, n0, x, x_stride, m0, mrows, gate);
                block_any(Wb, W8, K, N, n0 + rows_out, x, x_stride, m0, mrows, acc);
                store_block(acc, n0 + rows_out, rows, m0, mrows, scale, out, out_stride, res, res_stride, mode,
                            rows_out, gate);
            } else {
                block_any(Wb, W8, K, N, n0, x, x_stride, m0, mrows, acc);
                store_block(acc, n0, rows, m0, mrows, scale, out, out_stride, res, res_stride, mode, 0, gate);
            }
        }
    }
    return 0;
}

#endif

/* x: [M, K] bf16 rows at x_stride; W: [N, K] bf16 contiguous; out: [M, N or N/2] bf16 rows at
   out_stride; res: [M, N] bf16 rows at res_stride (mode 1 only) */
int gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* W, uint16_t* out, int64_t out_stride,
              const uint16_t* res, int64_t res_stride, int M, int N, int K, int mode) {
#if GEMV_OK
    return gemv_run(x, x_stride, W, 0, 0, out, out_stride, res, res_stride, M, N, K, mode);
#else
    return -1;
#endif
}

/* As gemv_bf16 with W: [N, K] int8 and scale: [N] float32 (row n's weights are W[n] * scale[n]) */
int gemv_w8_bf16(const uint16_t* x, int64_t x_stride, const int8_t* W, const float* scale,
                 uint16_t* out, int64_t out_stride, const uint16_t* res, int64_t res_stride, int M, int N, int K,
                 int mode) {
#if GEMV_OK
    return gemv_run(x, x_stride, 0, W, scale, out, out_stride, res, res_stride, M, N, K, mode);
#else
    return -1;
#endif
}
