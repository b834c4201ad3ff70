/* cpu_gemv.c's block kernels on AVX-512 BF16, VBMI and VNNI (Zen 4, Sapphire Rapids and later):
   included by cpu_gemv.c alone, which defines RB, MB and CW and calls block_bf16, block_i8 and
   dequantize_block. bf16 W goes straight into vdpbf16ps; int8 W (two's complement) is
   sign-extended to int16 and multiplied in integers against x in 16-bit fixed point (vpdpwssd). */
#ifndef PDSERVE_CPU_GEMV_AVX512_H
#define PDSERVE_CPU_GEMV_AVX512_H

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

/* x rows as the int8 blocks take them (xq_init): each row in 16-bit fixed point, q = round(x / s)
   with s = amax / 32767 (|q| <= 32767); per chunk 64 int16, each group of 8 columns stored twice
   (the two rows of a packed pair read it): [chunks][4 groups][2][8]. Error at most s / 2 per
   value, 2^-16 of the row's largest: below bf16's own rounding of x (2^-9 of each value) for
   every value within 2^7 of the largest, and smaller ones add at most that much. Per x row
   [chunks][64] int16. */
static int xq_init(xq_rows* xq, const uint16_t* x, int64_t x_stride, int M, int64_t K) {
    const int64_t chunks = (K + CW - 1) / CW;
    if (xq_alloc(xq, M, 64 * chunks) != 0) return -1;
    /* output int16 j of a chunk's 64 is column 8 (j / 16) + j % 8: the chunk's 32 q, permuted */
    int16_t idx[64];
    for (int j = 0; j < 64; j++) idx[j] = (int16_t)(8 * (j / 16) + j % 8);
    const __m512i idx0 = _mm512_loadu_si512(idx), idx1 = _mm512_loadu_si512(idx + 32);
    for (int m = 0; m < M; m++) {
        const uint16_t* row = x + m * x_stride;
        __m512 mx = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
            mx = _mm512_max_ps(mx, _mm512_abs_ps(widen_bf16(_mm256_maskz_loadu_epi16(lanes16((int)(K - k)), row + k))));
        const float amax = _mm512_reduce_max_ps(mx);
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        int16_t* v = xq->v + m * xq->row_elems;
        for (int64_t k = 0; k < K; k += CW, v += 64) {
            __m256i q[2];
            for (int h = 0; h < 2; h++) {  /* zero past K, as the weights are */
                const int64_t kh = k + 16 * h;
                const __m256i b = _mm256_maskz_loadu_epi16(lanes16(K > kh ? (int)(K - kh) : 0), row + kh);
                q[h] = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(widen_bf16(b), inv)));
            }
            const __m512i qs = _mm512_inserti64x4(_mm512_castsi256_si512(q[0]), q[1], 1);
            _mm512_storeu_si512(v, _mm512_permutexvar_epi16(idx0, qs));
            _mm512_storeu_si512(v + 32, _mm512_permutexvar_epi16(idx1, qs));
        }
        xq->scale[m] = amax / 32767.f;
    }
    return 0;
}

/* Sums of int8 B (two's complement; rows paired as gemv_layout.py says: in each 64-byte pair, 8
   columns of one row then the same 8 of the other) against xq rows m0..m0+MR-1, in units of the
   rows' scales. 32 weights at a time sign-extended to int16 from memory (half a pair: two groups
   of both rows), then vpdpwssd against x's 32 int16: in the int32 lanes, mask 0x0F0F is the
   pair's first row, 0xF0F0 its second. Integer sums are exact; a lane gains at most 4 * 127 *
   32767 per chunk, so they move to float32 every 64 chunks, and Q8_0 (``cs``) moves each chunk's,
   times its scale. Per 32 weights one sign extension and one dot product per x row, where the
   earlier kernel's byte lookups, sign OR and unpacks to bf16 took 3.5 instructions before its
   dot product (cpu_gemv.c has the measured steps). */
static inline __attribute__((always_inline)) void block_i8(const int8_t* B, int64_t K, const xq_rows* xq, int m0,
                                                           const int MR, float acc[RB][MB],
                                                           const float* const cs[RB]) {
    const int64_t chunks = (K + CW - 1) / CW;
    __m512i a[2][2][MB];  /* [half pair][pair][x row]: two chains per pair */
    __m512 f[2][MB];
    for (int p = 0; p < 2; p++)
        for (int m = 0; m < MR; m++) {
            a[0][p][m] = a[1][p][m] = _mm512_setzero_si512();
            f[p][m] = _mm512_setzero_ps();
        }
    for (int64_t c = 0; c < chunks; c++, B += RB * CW) {
        for (int h = 0; h < 2; h++) {
            const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(B + 32 * h)));
            const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(B + 64 + 32 * h)));
            for (int m = 0; m < MR; m++) {
                const __m512i xv = _mm512_loadu_si512(xq->v + (m0 + m) * xq->row_elems + 64 * c + 32 * h);
                a[h][0][m] = _mm512_dpwssd_epi32(a[h][0][m], w0, xv);
                a[h][1][m] = _mm512_dpwssd_epi32(a[h][1][m], w1, xv);
            }
        }
        if (cs || (c + 1) % 64 == 0 || c + 1 == chunks) {
            for (int p = 0; p < 2; p++) {
                const __m512 s = cs ? _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(cs[2 * p][c]),
                                                           _mm512_set1_ps(cs[2 * p + 1][c]))
                                    : _mm512_set1_ps(1.f);
                for (int m = 0; m < MR; m++) {
                    const __m512 v = _mm512_cvtepi32_ps(_mm512_add_epi32(a[0][p][m], a[1][p][m]));
                    f[p][m] = _mm512_fmadd_ps(v, s, f[p][m]);
                    a[0][p][m] = a[1][p][m] = _mm512_setzero_si512();
                }
            }
        }
    }
    for (int p = 0; p < 2; p++)
        for (int m = 0; m < MR; m++) {
            acc[2 * p][m] = _mm512_mask_reduce_add_ps(0x0F0F, f[p][m]);
            acc[2 * p + 1][m] = _mm512_mask_reduce_add_ps(0xF0F0, f[p][m]);
        }
}

/* Dequantize block b of a packed int8 W (both halves for SwiGLU) into bf16 rows of ld elements,
   each weight bf16(q * scale) as Int8Weight.dequantize rounds it: a byte permutation gathers each
   row of a pair, then sign extension, one float32 product and round to nearest even. ``scale``
   null: q itself (exact in bf16; the AMX products scale the sums instead). Output row i of half
   h (i counted over the half's rows) goes to row h * half_rows + i - base of out (the whole
   [N, K]: ld K, half_rows rows_out, base 0). */
static void dequantize_block(const int8_t* W, const float* scale, int blocked, int rows_out, int64_t K, int halves,
                             int64_t chunks, int b, uint16_t* out, int64_t ld, int64_t half_rows, int64_t base) {
    uint8_t idx[64];  /* output byte j: row j / 32 of the pair, column j % 32 */
    for (int j = 0; j < 64; j++) idx[j] = (uint8_t)(16 * ((j % 32) / 8) + 8 * (j / 32) + j % 8);
    const __m512i gather = _mm512_loadu_si512(idx);
    const int rows = rows_out - b * RB < RB ? rows_out - b * RB : RB;
    for (int h = 0; h < halves; h++) {
        const int8_t* B = W + ((int64_t)b * halves + h) * chunks * RB * CW;
        const int64_t row0 = (int64_t)h * rows_out + b * RB;
        for (int64_t c = 0; c < chunks; c++, B += RB * CW) {
            const int64_t k = c * CW;
            const __mmask32 mask = chunk_mask(k, K);
            for (int p = 0; p < RB / 2; p++) {
                const __m512i w = _mm512_permutexvar_epi8(gather, _mm512_loadu_si512(B + p * 64));
                for (int j = 0; j < 2 && 2 * p + j < rows; j++) {
                    const int64_t row = row0 + 2 * p + j;
                    const __m256i q = j ? _mm512_extracti64x4_epi64(w, 1) : _mm512_castsi512_si256(w);
                    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
                    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
                    __m512i v;
                    if (scale) {
                        const __m512 s = _mm512_set1_ps(blocked ? scale[row * chunks + c] : scale[row]);
                        v = _mm512_inserti64x4(_mm512_castsi256_si512(round_bf16(_mm512_mul_ps(lo, s))),
                                               round_bf16(_mm512_mul_ps(hi, s)), 1);
                    } else {
                        v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
                    }
                    _mm512_mask_storeu_epi16(out + (h * half_rows + b * RB + 2 * p + j - base) * ld + k, mask, v);
                }
            }
        }
    }
}

#endif
