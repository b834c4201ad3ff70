/* cpu_gemv.c's block kernels on AVX2 and FMA (any x86-64 since Haswell and Zen 1; no AVX-512):
   included by cpu_gemv.c alone, which defines RB, MB and CW and calls block_bf16, block_i8 and
   dequantize_block. The same packed layout as the AVX-512 kernels and, for bf16, the same sums
   (float32 products of exact operands) in another order; results differ from theirs in the last
   bits only, and each path agrees with itself, per op and fused.

   Without bf16 dot products, bf16 W is widened to float32 by two bit operations per 16 values
   (the even columns shifted up 16 bits, the odd ones masked), x the same way, so the products
   pair column 2i with 2i and 2i + 1 with 2i + 1, no shuffles. int8 W is
   multiplied in integers against x in 30-bit fixed point (block_i8). Each x row runs over the
   block on its own: the block (4 rows x K) stays in L1 for the next x row, and 16 ymm registers
   hold one row's sums. */
#ifndef PDSERVE_CPU_GEMV_AVX2_H
#define PDSERVE_CPU_GEMV_AVX2_H

static inline float hsum128(__m128 s) {
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
static inline float hsum256(__m256 v) {
    return hsum128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

/* x row xr's chunk k..k+31 as bf16, zero past K */
static inline __attribute__((always_inline)) void x_chunk(const uint16_t* xr, int64_t k, int64_t K,
                                                          uint16_t tail[CW], const uint16_t** at) {
    if (K - k >= CW) {
        *at = xr + k;
    } else {
        memset(tail, 0, CW * sizeof(uint16_t));
        memcpy(tail, xr + k, (size_t)(K - k) * sizeof(uint16_t));
        *at = tail;
    }
}

/* bf16 pairs -> float32: the even columns (low halves) and the odd ones (high halves) */
static inline __m256 even_f32(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
static inline __m256 odd_f32(__m256i v) {
    return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
}

/* Sums of one packed block B ([chunks][RB][32] bf16) against x rows m0..m0+MR-1. */
static inline __attribute__((always_inline)) void block_bf16(const uint16_t* B, int64_t K, const uint16_t* x,
                                                             int64_t x_stride, int m0, const int MR,
                                                             float acc[RB][MB]) {
    for (int m = 0; m < MR; m++) {
        const uint16_t* xr = x + (int64_t)(m0 + m) * x_stride;
        __m256 a[RB][2];
        for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const uint16_t* Bc = B;
        for (int64_t k = 0; k < K; k += CW, Bc += RB * CW) {
            uint16_t tail[CW];
            const uint16_t* xc;
            x_chunk(xr, k, K, tail, &xc);
            for (int h = 0; h < 2; h++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i*)(xc + 16 * h));
                const __m256 xe = even_f32(xv), xo = odd_f32(xv);
                for (int r = 0; r < RB; r++) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i*)(Bc + r * CW + 16 * h));
                    a[r][0] = _mm256_fmadd_ps(even_f32(wv), xe, a[r][0]);
                    a[r][1] = _mm256_fmadd_ps(odd_f32(wv), xo, a[r][1]);
                }
            }
        }
        for (int r = 0; r < RB; r++) acc[r][m] = hsum256(_mm256_add_ps(a[r][0], a[r][1]));
    }
}

/* x rows as the int8 blocks take them (xq_init): each row in fixed point, q = round(x / s) with s a
   power of two and |q| < 2^29, split as q = 2^15 h + l (h signed, 0 <= l < 2^15, both int16);
   each group of 8 columns stored twice (the two rows of a packed pair read it), per chunk
   [4 groups][16] of h, then of l after all chunks. Exact for every bf16 value within 2^22 of its
   row's largest (bf16 has 8 significant bits); smaller ones to 2^-30 of it. Per x row
   [chunks][64] h, then [chunks][64] l. */
static int xq_init(xq_rows* xq, const uint16_t* x, int64_t x_stride, int M, int64_t K) {
    const int64_t chunks = (K + CW - 1) / CW, half = chunks * 64;
    if (xq_alloc(xq, M, 2 * half) != 0) return -1;
    for (int m = 0; m < M; m++) {
        const uint16_t* row = x + m * x_stride;
        float amax = 0.f;
        for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(bf16_to_f32(row[k])));
        int e = 0;
        if (amax > 0.f) frexpf(amax, &e);  /* amax < 2^e */
        const float inv = ldexpf(1.f, 29 - e);
        int16_t* h = xq->v + m * xq->row_elems;
        int16_t* l = h + half;
        memset(h, 0, (size_t)xq->row_elems * sizeof(int16_t));  /* zero past K (so are the weights) */
        for (int64_t k = 0; k < K; k++) {
            const int32_t q = (int32_t)lrintf(bf16_to_f32(row[k]) * inv);
            const int64_t at = (k / CW) * 64 + (k % CW) / 8 * 16 + k % 8;
            h[at] = h[at + 8] = (int16_t)(q >> 15);
            l[at] = l[at + 8] = (int16_t)(q & 0x7fff);
        }
        xq->scale[m] = ldexpf(1.f, e - 29);
    }
    return 0;
}

/* 2^15 h + l as float32 (h, l: int32 sums) */
static inline __m256 hl_f32(__m256i h, __m256i l) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(h), _mm256_set1_ps(32768.f), _mm256_cvtepi32_ps(l));
}

/* Sums of int8 B (two's complement; rows paired as gemv_layout.py says: in each 64-byte pair, 8
   columns of one row then the same 8 of the other) against xq rows m0..m0+MR-1, in units of the
   rows' scales: 16 weights sign-extended to int16 from memory, then vpmaddwd against h and l,
   integer sums exact. A lane gains at most 4 * 2 * 127 * 2^15 per chunk, so the sums move to
   float32 every 32 chunks; Q8_0 (``cs``) moves each chunk's, times its scale. Measured on Zen 1
   in L2: 12 G weights/s, against 6.7 for sign extension to int32, conversion and float FMAs
   (the conversions were the bound), so int8 reads at memory speed where bf16 does. */
static inline __attribute__((always_inline)) void block_i8(const int8_t* B, int64_t K, const xq_rows* xq, int m0,
                                                           const int MR, float acc[RB][MB],
                                                           const float* const cs[RB]) {
    const int64_t chunks = (K + CW - 1) / CW, half = chunks * 64;
    for (int m = 0; m < MR; m++) {
        const int16_t* xh = xq->v + (m0 + m) * xq->row_elems;
        const int16_t* xl = xh + half;
        /* per pair p: lanes 0-3 row 2p, lanes 4-7 row 2p + 1 */
        __m256 f[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256i h[2], l[2];
        for (int p = 0; p < 2; p++) h[p] = l[p] = _mm256_setzero_si256();
        const int8_t* Bc = B;
        for (int64_t c = 0; c < chunks; c++, Bc += RB * CW) {
            for (int p = 0; p < 2; p++)
                for (int g = 0; g < 4; g++) {
                    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(Bc + 64 * p + 16 * g)));
                    h[p] = _mm256_add_epi32(h[p], _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i*)(xh + 64 * c + 16 * g))));
                    l[p] = _mm256_add_epi32(l[p], _mm256_madd_epi16(w, _mm256_loadu_si256((const __m256i*)(xl + 64 * c + 16 * g))));
                }
            if (cs || (c + 1) % 32 == 0 || c + 1 == chunks) {
                for (int p = 0; p < 2; p++) {
                    const __m256 v = hl_f32(h[p], l[p]);
                    if (cs) {
                        const __m256 s = _mm256_setr_m128(_mm_set1_ps(cs[2 * p][c]), _mm_set1_ps(cs[2 * p + 1][c]));
                        f[p] = _mm256_fmadd_ps(v, s, f[p]);
                    } else {
                        f[p] = _mm256_add_ps(f[p], v);
                    }
                    h[p] = l[p] = _mm256_setzero_si256();
                }
            }
        }
        for (int p = 0; p < 2; p++) {
            acc[2 * p][m] = hsum128(_mm256_castps256_ps128(f[p]));
            acc[2 * p + 1][m] = hsum128(_mm256_extractf128_ps(f[p], 1));
        }
    }
}

/* Dequantize block b of a packed int8 W (both halves for SwiGLU) into bf16 rows of ld elements,
   each weight bf16(q * scale) as Int8Weight.dequantize rounds it (q two's complement; scale null:
   q itself); plain C. Rows placed as the AVX-512 version's. */
static void dequantize_block(const int8_t* W, const float* scale, int blocked, int rows_out, int64_t K, int halves,
                             int64_t chunks, int b, uint16_t* out, int64_t ld, int64_t half_rows, int64_t base) {
    const int rows = rows_out - b * RB < RB ? rows_out - b * RB : RB;
    for (int h = 0; h < halves; h++) {
        const int8_t* B = W + ((int64_t)b * halves + h) * chunks * RB * CW;
        const int64_t row0 = (int64_t)h * rows_out + b * RB;
        for (int64_t c = 0; c < chunks; c++, B += RB * CW)
            for (int r = 0; r < rows; r++) {
                const int64_t row = row0 + r;
                const float s = !scale ? 1.f : blocked ? scale[row * chunks + c] : scale[row];
                const int8_t* P = B + (r / 2) * 64 + (r % 2) * 8;
                for (int g = 0; g < 4; g++)
                    for (int e = 0; e < 8; e++) {
                        const int64_t k = c * CW + 8 * g + e;
                        if (k >= K) break;
                        out[(h * half_rows + b * RB + r - base) * ld + k] = f32_to_bf16((float)P[16 * g + e] * s);
                    }
            }
    }
}

#endif
