/* cpu_gemv.c's block kernels on AVX2 and FMA (any x86-64 since Haswell and Zen 1; no AVX-512):
   included by cpu_gemv.c alone, which defines RB, MB and CW and calls block_bf16, block_i8 and
   dequantize_block. The same packed layout and the same sums as the AVX-512 kernels (float32
   products of exact operands), in another order, so results differ from theirs in the last bits
   only; each path agrees with itself, per op and fused.

   Without bf16 dot products, bf16 W is widened to float32 by two bit operations per 16 values
   (the even columns shifted up 16 bits, the odd ones masked), x the same way, so the products
   pair column 2i with 2i and 2i + 1 with 2i + 1, no shuffles. int8 W (sign-magnitude) is turned
   into two's complement 32 bytes at a time, then sign-extended 8 values at a time and converted
   to float32. Each x row runs over the block on its own: the block (4 rows x K) stays
   in L1 for the next x row, and 16 ymm registers hold one row's sums. */
#ifndef PDSERVE_CPU_GEMV_AVX2_H
#define PDSERVE_CPU_GEMV_AVX2_H

static inline float hsum256(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
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

/* 8 int8 weights (two's complement) -> float32 */
static inline __attribute__((always_inline)) __m256 int8_f32(const int8_t* P) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)P)));
}

/* The same for int8 B (rows paired as gemv_layout.py says: in each 64-byte pair, 8 columns of
   one row then the same 8 of the other); sums unscaled, or (``cs``, Q8_0) each chunk's scaled by
   its own scale before it joins the row's. Each chunk's 128 bytes go from sign-magnitude to two's
   complement 32 at a time (vpsignb) into a buffer in L1 first, so that widening 8 weights to
   float32 is a sign extension from memory and one conversion. */
static inline __attribute__((always_inline)) void block_i8(const int8_t* B, int64_t K, const uint16_t* x,
                                                           int64_t x_stride, int m0, const int MR,
                                                           float acc[RB][MB], const float* const cs[RB]) {
    const __m256i low7 = _mm256_set1_epi8(0x7f);
    for (int m = 0; m < MR; m++) {
        const uint16_t* xr = x + (int64_t)(m0 + m) * x_stride;
        __m256 a[RB][2];
        for (int r = 0; r < RB; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const int8_t* Bc = B;
        for (int64_t k = 0, c = 0; k < K; k += CW, c++, Bc += RB * CW) {
            uint16_t tail[CW];
            const uint16_t* xc;
            x_chunk(xr, k, K, tail, &xc);
            __m256 xf[4];  /* columns 8g..8g+7 */
            for (int g = 0; g < 4; g++)
                xf[g] = _mm256_castsi256_ps(
                    _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(xc + 8 * g))), 16));
            int8_t tc[RB * CW] __attribute__((aligned(32)));
            for (int v = 0; v < RB * CW / 32; v++) {
                const __m256i q = _mm256_loadu_si256((const __m256i*)(Bc + 32 * v));
                _mm256_store_si256((__m256i*)(tc + 32 * v), _mm256_sign_epi8(_mm256_and_si256(q, low7), q));
            }
            for (int r = 0; r < RB; r++) {
                const int8_t* P = tc + (r / 2) * 64 + (r % 2) * 8;
                if (cs) {
                    __m256 t = _mm256_mul_ps(int8_f32(P), xf[0]);
                    for (int g = 1; g < 4; g++) t = _mm256_fmadd_ps(int8_f32(P + 16 * g), xf[g], t);
                    a[r][0] = _mm256_fmadd_ps(t, _mm256_set1_ps(cs[r][c]), a[r][0]);
                } else {
                    for (int g = 0; g < 4; g++)
                        a[r][g & 1] = _mm256_fmadd_ps(int8_f32(P + 16 * g), xf[g], a[r][g & 1]);
                }
            }
        }
        for (int r = 0; r < RB; r++) acc[r][m] = hsum256(_mm256_add_ps(a[r][0], a[r][1]));
    }
}

/* Dequantize block b of a packed int8 W (both halves for SwiGLU) into out [N, K] bf16 row-major,
   each weight bf16(q * scale) as Int8Weight.dequantize rounds it; plain C */
static void dequantize_block(const int8_t* W, const float* scale, int blocked, int rows_out, int64_t K, int halves,
                             int64_t chunks, int b, uint16_t* out) {
    const int rows = rows_out - b * RB < RB ? rows_out - b * RB : RB;
    for (int h = 0; h < halves; h++) {
        const int8_t* B = W + ((int64_t)b * halves + h) * chunks * RB * CW;
        const int64_t row0 = (int64_t)h * rows_out + b * RB;
        for (int64_t c = 0; c < chunks; c++, B += RB * CW)
            for (int r = 0; r < rows; r++) {
                const int64_t row = row0 + r;
                const float s = blocked ? scale[row * chunks + c] : scale[row];
                const int8_t* P = B + (r / 2) * 64 + (r % 2) * 8;
                for (int g = 0; g < 4; g++)
                    for (int e = 0; e < 8; e++) {
                        const int64_t k = c * CW + 8 * g + e;
                        if (k >= K) break;
                        const int q = (uint8_t)P[16 * g + e];
                        const float v = (float)((q & 0x80) ? -(q & 0x7f) : q);
                        out[row * K + k] = f32_to_bf16(v * s);
                    }
            }
    }
}

#endif
