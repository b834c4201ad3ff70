/* cpu_gemv.c's block kernels on AVX-512 BF16 and VBMI (Zen 4, Sapphire Rapids): included by
   cpu_gemv.c alone, which defines RB, MB and CW and calls block_bf16, block_i8 and
   dequantize_block. bf16 W goes straight into vdpbf16ps; int8 W is widened to bf16 in registers
   by byte lookups first (gemv_layout.py says how the bytes lie). */
#ifndef PDSERVE_CPU_GEMV_AVX512_H
#define PDSERVE_CPU_GEMV_AVX512_H

/* int8 weights stored sign-magnitude (gemv_layout.SIGN_MAGNITUDE): the lookups index |q| */
#define GEMV_INT8_TWOS 0

/* x as it is: nothing to prepare for the int8 blocks */
typedef struct { int none; } xq_rows;
static inline int xq_init(xq_rows* xq, const uint16_t* x, int64_t x_stride, int M, int64_t K) {
    (void)xq; (void)x; (void)x_stride; (void)M; (void)K;
    return 0;
}
static inline void xq_free(xq_rows* xq) { (void)xq; }
static inline float xq_scale(const xq_rows* xq, int m) { (void)xq; (void)m; return 1.f; }

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
                                                           int64_t x_stride, const xq_rows* xq, int m0,
                                                           const int MR, float acc[RB][MB],
                                                           const float* const cs[RB]) {
    (void)xq;
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

/* Dequantize block b of a packed int8 W (both halves for SwiGLU) into out [N, K] bf16 row-major:
   the same lookups as block_i8, each product rounded as f32_to_bf16 */
static void dequantize_block(const int8_t* W, const float* scale, int blocked, int rows_out, int64_t K, int halves,
                             int64_t chunks, int b, uint16_t* out) {
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
                    _mm512_mask_storeu_epi16(out + row * K + k, mask, v);
                }
            }
        }
    }
}

#endif
