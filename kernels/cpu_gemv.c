/* Skinny matrix products for the decode step: out[M, N] = x[M, K] @ W[N, K]^T with M small
   (a decode batch of a few sequences), W bf16 or int8 with per-output-channel float32 scales,
   packed as gemv_layout.py describes (GemvWeight). Built by cpu_native.py.

   At M = 1 a decode step is a stream over the weights, and a product's only job is to keep
   up with memory. oneDNN's prepacked bf16 linear reads W at about 13 GB/s on one Zen 4 core
   where a plain sum over the same bytes reads 25-29 GB/s (scripts/profile_decode_step.py,
   lm_head_*). These loops stream W once, as one sequential run (the packed layout), through
   AVX-512 BF16 dot products (vdpbf16ps) with every x row held in L1, at the plain read's rate:
   the LM head at one row 35 GB/s against a sum's 34 (load 3.5); the same loops over row-major
   W read 10-21 GB/s (4 short row streams, prefetched or not). int8 is widened to bf16 in
   registers by byte lookups (exact: |q| <= 127 fits bf16's 8-bit significand), then
   multiplied as bf16 W, also at the read's rate (the default model's 121 products at one row:
   6.4 ms for 135 MB, 12.7 ms before the lookups and the layout); torch's
   ``_weight_int8pack_mm`` reads int8 at ~6 GB/s here. From 3 rows of x on, the dot products
   (~1.1 ns each on this machine), not memory, set the time.

   Output rows are split across OpenMP threads in blocks of 4; each block runs over every x
   row (4 at a time), so W is read from memory once per call whatever M is. Sums are float32
   over 32-column chunks in column order, reduced once per row, rounded to bf16 once at the
   end as oneDNN rounds. Epilogues (``mode``), as the model's oneDNN post-ops do them:
     0: out = bf16(acc)
     1: out = bf16(acc + res)                      the residual add fused into o and down
     2: W is [2 I, K] = gate | up (packed as SwiGLU) and out is [M, I]:
        out = bf16(acc_up * bf16(silu(acc_gate)))
   int8 weights carry one scale per row, or (Q8_0, ``blocked``) one per row and 32-column chunk,
   which then multiplies that chunk's dot products before they join the row's sums.
   Returns 0, or -1 where the CPU lacks AVX-512 BF16 or VBMI, the int8 lookups' vpermi2b
   (``gemv_supported``: Zen 4 and Sapphire Rapids have both, Cooper Lake BF16 alone; where it
   is 0 the model's products go through oneDNN). */
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#include "cpu_bf16_avx512.h"
#define GEMV_OK 1
#else
#define GEMV_OK 0
#endif

int gemv_supported(void) { return GEMV_OK; }

#if GEMV_OK

#define RB 4   /* W rows per block (gemv_layout.ROWS) */
#define MB 4   /* x rows per pass */
#define CW 32  /* columns per chunk (gemv_layout.CHUNK) */

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

/* the columns of chunk k..k+31 that are below K */
static inline __mmask32 chunk_mask(int64_t k, int64_t K) {
    return K - k >= CW ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
}

/* x rows m0..m0+MR-1, chunk k..k+31 (masked past K) */
static inline __attribute__((always_inline)) void load_x(__m512i xv[MB], const uint16_t* x, int64_t x_stride,
                                                         int m0, const int MR, int64_t k, int64_t K) {
    const __mmask32 mask = chunk_mask(k, K);
    for (int m = 0; m < MR; m++) xv[m] = _mm512_maskz_loadu_epi16(mask, x + (int64_t)(m0 + m) * x_stride + k);
}

/* Sums of one packed block B ([chunks][RB][32] bf16) against x rows m0..m0+MR-1. Always inlined
   with a literal MR, so the accumulators stay in registers. No software prefetch: the block is
   one run of memory the hardware prefetcher follows (prefetching 256 B-1 KB ahead measured
   0-25% slower). */
static inline __attribute__((always_inline)) void block_bf16(const uint16_t* B, int64_t K, const uint16_t* x,
                                                             int64_t x_stride, int m0, const int MR,
                                                             float acc[RB][MB]) {
    __m512 a[RB][MB];
    for (int r = 0; r < RB; r++)
        for (int m = 0; m < MR; m++) a[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += CW, B += RB * CW) {
        __m512i xv[MB];
        load_x(xv, x, x_stride, m0, MR, k, K);
        for (int r = 0; r < RB; r++) {
            const __m512i wv = _mm512_loadu_si512(B + r * CW);
            for (int m = 0; m < MR; m++) a[r][m] = _mm512_dpbf16_ps(a[r][m], (__m512bh)wv, (__m512bh)xv[m]);
        }
    }
    for (int r = 0; r < RB; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm512_reduce_add_ps(a[r][m]);
}

/* bf16(m) for m = 0..127, low and high bytes: the int8 widening's lookup tables */
static uint8_t bf16_lo[128], bf16_hi[128];
__attribute__((constructor)) static void init_tables(void) {
    for (int m = 0; m < 128; m++) {
        const uint16_t b = f32_to_bf16((float)m);
        bf16_lo[m] = (uint8_t)b;
        bf16_hi[m] = (uint8_t)(b >> 8);
    }
}

/* the lookup tables in registers, and the sign bit */
typedef struct { __m512i lo0, lo1, hi0, hi1, sign; } widen_tables;

static inline __attribute__((always_inline)) widen_tables load_widen_tables(void) {
    const widen_tables t = {_mm512_loadu_si512(bf16_lo), _mm512_loadu_si512(bf16_lo + 64),
                            _mm512_loadu_si512(bf16_hi), _mm512_loadu_si512(bf16_hi + 64),
                            _mm512_set1_epi8((char)0x80)};
    return t;
}

/* one 64-byte pair of packed int8 rows (sign-magnitude) -> the two rows' 32 bf16 each, w[0] and w[1] */
static inline __attribute__((always_inline)) void widen_pair(const widen_tables* t, const int8_t* P, __m512i w[2]) {
    const __m512i q = _mm512_loadu_si512(P);
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, q, t->lo1);
    /* hi | (q & 0x80) */
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, q, t->hi1), q, t->sign, 0xF8);
    w[0] = _mm512_unpacklo_epi8(lo, hi);
    w[1] = _mm512_unpackhi_epi8(lo, hi);
}

/* the same for int8 B (sign-magnitude, rows paired as gemv_layout.py says; sums unscaled): each
   64-byte pair becomes two rows of 32 bf16 by two 128-entry byte lookups (vpermi2b, indexed by
   the low 7 bits), the sign ORed into the high byte, and a byte unpack; then the same dot
   products as bf16 W, so the sums are those of the dequantized-in-registers row-major loop. */
static inline __attribute__((always_inline)) void block_i8(const int8_t* B, int64_t K, const uint16_t* x,
                                                           int64_t x_stride, int m0, const int MR,
                                                           float acc[RB][MB], const float* const cs[RB]) {
    const widen_tables t = load_widen_tables();
    __m512 a[RB][MB];
    for (int r = 0; r < RB; r++)
        for (int m = 0; m < MR; m++) a[r][m] = _mm512_setzero_ps();
    if (cs) {  /* Q8_0: each chunk's sums times its own scale (cs[r][c]: row r's scale of chunk c) */
        for (int64_t k = 0, c = 0; k < K; k += CW, c++, B += RB * CW) {
            __m512i xv[MB];
            load_x(xv, x, x_stride, m0, MR, k, K);
            for (int p = 0; p < RB / 2; p++) {
                __m512i w[2];
                widen_pair(&t, B + p * 64, w);
                const __m512 s0 = _mm512_set1_ps(cs[2 * p][c]), s1 = _mm512_set1_ps(cs[2 * p + 1][c]);
                for (int m = 0; m < MR; m++) {
                    const __m512 z = _mm512_setzero_ps();
                    a[2 * p][m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(z, (__m512bh)w[0], (__m512bh)xv[m]), s0,
                                                  a[2 * p][m]);
                    a[2 * p + 1][m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(z, (__m512bh)w[1], (__m512bh)xv[m]), s1,
                                                      a[2 * p + 1][m]);
                }
            }
        }
        for (int r = 0; r < RB; r++)
            for (int m = 0; m < MR; m++) acc[r][m] = _mm512_reduce_add_ps(a[r][m]);
        return;
    }
    for (int64_t k = 0; k < K; k += CW, B += RB * CW) {
        __m512i xv[MB];
        load_x(xv, x, x_stride, m0, MR, k, K);
        for (int p = 0; p < RB / 2; p++) {
            __m512i w[2];
            widen_pair(&t, B + p * 64, w);
            for (int m = 0; m < MR; m++) {
                a[2 * p][m] = _mm512_dpbf16_ps(a[2 * p][m], (__m512bh)w[0], (__m512bh)xv[m]);
                a[2 * p + 1][m] = _mm512_dpbf16_ps(a[2 * p + 1][m], (__m512bh)w[1], (__m512bh)xv[m]);
            }
        }
    }
    for (int r = 0; r < RB; r++)
        for (int m = 0; m < MR; m++) acc[r][m] = _mm512_reduce_add_ps(a[r][m]);
}

/* one block for either weight type and any mrows in 1..MB, each case with a literal MR;
   ``block`` is the block's index in 32-column chunks of RB rows from the start of W; ``cs``: its
   rows' chunk scales (Q8_0), or null */
static void block_any(const uint16_t* Wb, const int8_t* W8, int64_t K, int64_t block, const uint16_t* x,
                      int64_t x_stride, int m0, int mrows, float acc[RB][MB], const float* const cs[RB]) {
    const int64_t at = block * ((K + CW - 1) / CW) * RB * CW;
#define BLOCK_CASE(MR) case MR: \
        if (W8) block_i8(W8 + at, K, x, x_stride, m0, MR, acc, cs); \
        else block_bf16(Wb + at, K, x, x_stride, m0, MR, acc); \
        break;
    switch (mrows) { BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4) }
#undef BLOCK_CASE
}

/* Q8_0: the chunk scales of output rows row0.. of ``rows`` (scale: [N, chunks]); a padding row
   past N takes row0's, its weights being zero */
static inline void chunk_scales(const float* scale, int64_t chunks, int64_t row0, int rows, const float* cs[RB]) {
    for (int r = 0; r < RB; r++) cs[r] = scale + (row0 + (r < rows ? r : 0)) * chunks;
}

/* One driver for both weight types: ``W8`` non-null selects int8 (with ``scale``). */
static int gemv_run(const uint16_t* x, int64_t x_stride, const uint16_t* Wb, const int8_t* W8, const float* scale,
                    int blocked, uint16_t* out, int64_t out_stride, const uint16_t* res, int64_t res_stride,
                    int M, int N, int K, int mode) {
    const int64_t chunks = (K + CW - 1) / CW;
    /* the epilogue scales per row; Q8_0's scales were applied per chunk */
    const float* row_scale = blocked ? 0 : scale;
    /* mode 2: blocks over the I = N / 2 gate rows, each followed in W by its up rows' block */
    const int rows_out = mode == 2 ? N / 2 : N;
    const int nblocks = (rows_out + RB - 1) / RB;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        const int n0 = b * RB;
        const int rows = rows_out - n0 < RB ? rows_out - n0 : RB;
        /* Q8_0: this block's rows' chunk scales (the gate rows' for mode 2, then the up rows') */
        const float *cs[RB], *cs_up[RB];
        if (blocked) {
            chunk_scales(scale, chunks, n0, rows, cs);
            if (mode == 2) chunk_scales(scale, chunks, n0 + rows_out, rows, cs_up);
        }
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mrows = M - m0 < MB ? M - m0 : MB;
            float acc[RB][MB], gate[RB][MB];
            if (mode == 2) {
                block_any(Wb, W8, K, 2 * (int64_t)b, x, x_stride, m0, mrows, gate, blocked ? cs : 0);
                block_any(Wb, W8, K, 2 * (int64_t)b + 1, x, x_stride, m0, mrows, acc, blocked ? cs_up : 0);
                store_block(acc, n0 + rows_out, rows, m0, mrows, row_scale, out, out_stride, res, res_stride, mode,
                            rows_out, gate);
            } else {
                block_any(Wb, W8, K, b, x, x_stride, m0, mrows, acc, blocked ? cs : 0);
                store_block(acc, n0, rows, m0, mrows, row_scale, out, out_stride, res, res_stride, mode, 0, gate);
            }
        }
    }
    return 0;
}

#endif

/* x: [M, K] bf16 rows at x_stride; W: [N, K] bf16 packed (GemvWeight, as SwiGLU for mode 2);
   out: [M, N or N/2] bf16 rows at out_stride; res: [M, N] bf16 rows at res_stride (mode 1 only) */
int gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* W, uint16_t* out, int64_t out_stride,
              const uint16_t* res, int64_t res_stride, int M, int N, int K, int mode) {
#if GEMV_OK
    return gemv_run(x, x_stride, W, 0, 0, 0, out, out_stride, res, res_stride, M, N, K, mode);
#else
    return -1;
#endif
}

/* As gemv_bf16 with W: [N, K] int8 packed and scale: [N] float32 (row n's weights are W[n] * scale[n]);
   ``blocked`` (Q8_0): scale is [N, ceil(K / 32)], one per row and 32-column chunk */
int gemv_w8_bf16(const uint16_t* x, int64_t x_stride, const int8_t* W, const float* scale, int blocked,
                 uint16_t* out, int64_t out_stride, const uint16_t* res, int64_t res_stride, int M, int N, int K,
                 int mode) {
#if GEMV_OK
    return gemv_run(x, x_stride, 0, W, scale, blocked, out, out_stride, res, res_stride, M, N, K, mode);
#else
    return -1;
#endif
}

/* Dequantize a packed int8 W (N, K, ``swiglu`` as packed) to out: [N, K] bf16 row-major, each
   weight bf16(q * scale[n]) (``blocked``: q * scale[n][k / 32]) as
   ``quantization.Int8Weight.dequantize`` rounds it (exact q, one
   float32 product, round to nearest even): the larger steps' dense form of the int8 weights
   gemv streams. The same lookups as block_i8; -1 where gemv is not supported. */
int gemv_w8_dequantize(const int8_t* W, const float* scale, int blocked, int N, int K, int swiglu, uint16_t* out) {
#if GEMV_OK
    const int halves = swiglu ? 2 : 1, rows_out = N / halves;
    const int nblocks = (rows_out + RB - 1) / RB;
    const int64_t chunks = (K + CW - 1) / CW;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        const widen_tables t = load_widen_tables();
        const int rows = rows_out - b * RB < RB ? rows_out - b * RB : RB;
        for (int h = 0; h < halves; h++) {
            const int8_t* B = W + ((int64_t)b * halves + h) * chunks * RB * CW;
            const int64_t row0 = (int64_t)h * rows_out + b * RB;
            for (int64_t c = 0; c < chunks; c++, B += RB * CW) {
                const int64_t k = c * CW;
                const __mmask32 mask = chunk_mask(k, K);
                for (int p = 0; p < RB / 2; p++) {
                    __m512i w[2];
                    widen_pair(&t, B + p * 64, w);
                    for (int j = 0; j < 2 && 2 * p + j < rows; j++) {
                        const int64_t row = row0 + 2 * p + j;
                        const __m512 s = _mm512_set1_ps(blocked ? scale[row * chunks + c] : scale[row]);
                        __m256i half[2];
                        for (int e = 0; e < 2; e++)  /* the product rounded as f32_to_bf16 */
                            half[e] = round_bf16(_mm512_mul_ps(widen_bf16(e ? _mm512_extracti64x4_epi64(w[j], 1)
                                                                            : _mm512_castsi512_si256(w[j])), s));
                        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
                        _mm512_mask_storeu_epi16(out + (row0 + 2 * p + j) * K + k, mask, v);
                    }
                }
            }
        }
    }
    return 0;
#else
    return -1;
#endif
}
