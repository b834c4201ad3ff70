/* Weight-absorbed multi-head latent attention decode over latent pages, built by cpu_native.py.

   For decode row b with query q[b] [H, W] (W = kv_lora_rank R + rope dim, the query already in
   latent space) and its first len[b] cached tokens, each one latent vector lat[t] [W] shared by
   every head, stored in pages of ``page_size`` vectors (pool [1, pages, page_size, W]):
       out[b, h, :] = sum_t softmax_t(scale * q[b, h] . lat[t]) * lat[t, :R]

   Why this shape: every head reads the same latent vector, so a job (one row, a block of up to
   MLA_JOB_HEADS heads) walks the row's tokens once, a tile of MLA_TILE tokens at a time, while the
   tile sits in cache: (1) the scores of every head of the block against the tile, (2) one online
   softmax step per head and tile (float32 running max and sum; the accumulator is rescaled once
   per tile, not per token), (3) the probabilities times the tile's c part, MLA_REG_HEADS heads x
   MLA_REG_COLS columns at a time in registers, so each latent value is loaded once per register
   block and no accumulator is stored per token. The torch twin gathers the pages into a
   padded copy and runs two batched products.
   bf16 runs on AVX-512 BF16 (scores with vdpbf16ps: exact products, float32 sums; the weighted
   sum with vdpbf16ps over token pairs, the probabilities rounded to bf16 as the torch twin's are)
   where compiled with it and not ``portable``; otherwise, and for float32, plain loops of the same tiles that the compiler vectorizes. Jobs (rows x head blocks) run in
   parallel; a block is narrowed until there are jobs for every thread. Returns 0, or -1 when a
   page id is out of range. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MLA_DP 1
#else
#define MLA_DP 0
#endif

#define MLA_JOB_HEADS 16  /* heads per job: one pass over a row's tokens serves them all */
#define MLA_TILE 32       /* tokens per softmax step */
#define MLA_REG_HEADS 4   /* the weighted sum's register block: heads ... */
#define MLA_REG_COLS 64   /* ... x float32 columns (4 zmm each) */

int mla_decode_isa(void) { return MLA_DP ? 512 : 0; }

static float dot_portable(const void* a, const void* b, int64_t n, int bf16) {
    float s = 0.f;
    if (bf16) {
        const uint16_t *x = a, *y = b;
        for (int64_t i = 0; i < n; i++) s += bf16_to_f32(x[i]) * bf16_to_f32(y[i]);
    } else {
        const float *x = a, *y = b;
        for (int64_t i = 0; i < n; i++) s += x[i] * y[i];
    }
    return s;
}

/* acc[h, :R] += sum_t p[h, t] * lat[t, :R] for nh heads and nt tokens, plain loops */
static void weighted_sum_portable(float* acc, const float* p, const char* const* lat, int64_t nh, int64_t nt,
                                  int64_t R, int bf16) {
    float row[MLA_REG_COLS];
    for (int64_t r0 = 0; r0 < R; r0 += MLA_REG_COLS) {
        const int64_t nr = R - r0 < MLA_REG_COLS ? R - r0 : MLA_REG_COLS;
        for (int64_t t = 0; t < nt; t++) {
            if (bf16) { for (int64_t r = 0; r < nr; r++) row[r] = bf16_to_f32(((const uint16_t*)lat[t])[r0 + r]); }
            else memcpy(row, (const float*)lat[t] + r0, (size_t)nr * sizeof(float));
            for (int64_t h = 0; h < nh; h++) {
                const float w = p[h * MLA_TILE + t];
                float* a = acc + h * R + r0;
                for (int64_t r = 0; r < nr; r++) a[r] += w * row[r];
            }
        }
    }
}

#if MLA_DP
static inline float dot_bf16_avx512(const uint16_t* a, const uint16_t* b, int64_t n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + i + 32),
                                (__m512bh)_mm512_loadu_si512(b + i + 32));
    }
    for (; i < n; i += 32) {
        const __mmask32 m = n - i >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (n - i)) - 1);
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(m, a + i),
                                (__m512bh)_mm512_maskz_loadu_epi16(m, b + i));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* weighted_sum_portable for bf16 latents, two tokens per vdpbf16ps: the probabilities of a token
   pair are rounded to bf16 (as the torch twin's bf16 product rounds them) and broadcast as one
   dword, the pair's latent rows interleaved column by column (vpermt2w), so each instruction adds
   both tokens' products to 16 float32 columns. A block of MLA_REG_HEADS heads x MLA_REG_COLS
   columns accumulates in 16 registers over the tile's token pairs. */
static void weighted_sum_bf16_avx512(float* acc, const float* p, const char* const* lat, int64_t nh, int64_t nt,
                                     int64_t R) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    const int64_t np = (nt + 1) / 2;
    for (int64_t h0 = 0; h0 < nh; h0 += MLA_REG_HEADS) {
        const int64_t bh = nh - h0 < MLA_REG_HEADS ? nh - h0 : MLA_REG_HEADS;
        uint32_t w[MLA_REG_HEADS][MLA_TILE / 2];  /* each token pair's probabilities, bf16 x 2 */
        for (int64_t h = 0; h < MLA_REG_HEADS; h++)
            for (int64_t k = 0; k < np; k++) {
                const float* ph = p + (h0 + h) * MLA_TILE;
                const float a = h < bh ? ph[2 * k] : 0.f, b = h < bh && 2 * k + 1 < nt ? ph[2 * k + 1] : 0.f;
                w[h][k] = (uint32_t)f32_to_bf16(a) | ((uint32_t)f32_to_bf16(b) << 16);
            }
        for (int64_t r0 = 0; r0 < R; r0 += MLA_REG_COLS) {
            __mmask32 lm[2];
            __mmask16 sm[4];
            for (int j = 0; j < 2; j++) {
                const int64_t left = R - r0 - 32 * j;
                lm[j] = left >= 32 ? (__mmask32)0xffffffffu : left <= 0 ? (__mmask32)0 : (__mmask32)((1u << left) - 1);
            }
            for (int j = 0; j < 4; j++) {
                const int64_t left = R - r0 - 16 * j;
                sm[j] = left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
            }
            __m512 a[MLA_REG_HEADS][4];
            for (int64_t h = 0; h < MLA_REG_HEADS; h++)
                for (int j = 0; j < 4; j++)
                    a[h][j] = h < bh ? _mm512_maskz_loadu_ps(sm[j], acc + (h0 + h) * R + r0 + 16 * j) : _mm512_setzero_ps();
            for (int64_t k = 0; k < np; k++) {
                /* an odd tile's last pair repeats its token, with probability 0 */
                const uint16_t* x = (const uint16_t*)lat[2 * k] + r0;
                const uint16_t* y = (const uint16_t*)lat[2 * k + 1 < nt ? 2 * k + 1 : 2 * k] + r0;
                const __m512i x0 = _mm512_maskz_loadu_epi16(lm[0], x), y0 = _mm512_maskz_loadu_epi16(lm[0], y);
                const __m512i x1 = _mm512_maskz_loadu_epi16(lm[1], x + 32), y1 = _mm512_maskz_loadu_epi16(lm[1], y + 32);
                const __m512bh v0 = (__m512bh)_mm512_permutex2var_epi16(x0, lo, y0);
                const __m512bh v1 = (__m512bh)_mm512_permutex2var_epi16(x0, hi, y0);
                const __m512bh v2 = (__m512bh)_mm512_permutex2var_epi16(x1, lo, y1);
                const __m512bh v3 = (__m512bh)_mm512_permutex2var_epi16(x1, hi, y1);
                for (int64_t h = 0; h < MLA_REG_HEADS; h++) {
                    const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w[h][k]);
                    a[h][0] = _mm512_dpbf16_ps(a[h][0], v0, pw);
                    a[h][1] = _mm512_dpbf16_ps(a[h][1], v1, pw);
                    a[h][2] = _mm512_dpbf16_ps(a[h][2], v2, pw);
                    a[h][3] = _mm512_dpbf16_ps(a[h][3], v3, pw);
                }
            }
            for (int64_t h = 0; h < bh; h++)
                for (int j = 0; j < 4; j++) _mm512_mask_storeu_ps(acc + (h0 + h) * R + r0 + 16 * j, sm[j], a[h][j]);
        }
    }
}
#endif

int mla_decode(const void* q, const void* cache, const int32_t* page_table, const int32_t* seq_lens, void* out,
               int64_t n, int64_t H, int64_t W, int64_t R, int64_t page_size, int64_t max_pages,
               int64_t num_pages, float scale, int bf16, int portable) {
    const int64_t esz = bf16 ? 2 : 4;
    const int simd = MLA_DP && bf16 && !portable;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int64_t jh = H < MLA_JOB_HEADS ? H : MLA_JOB_HEADS;  /* narrower blocks until every thread has a job */
    while (jh > MLA_REG_HEADS && n * ((H + jh - 1) / jh) < threads) jh = (jh + 1) / 2;
    const int64_t hb = (H + jh - 1) / jh;
    int bad = 0;
    #pragma omp parallel for schedule(dynamic, 1) reduction(|:bad)
    for (int64_t job = 0; job < n * hb; job++) {
        const int64_t b = job / hb, h0 = (job % hb) * jh;
        const int64_t nh = H - h0 < jh ? H - h0 : jh;
        float m[MLA_JOB_HEADS], l[MLA_JOB_HEADS], p[MLA_JOB_HEADS * MLA_TILE];
        const char* lat[MLA_TILE];
        float* acc = calloc((size_t)(nh * R), sizeof(float));
        for (int64_t h = 0; h < nh; h++) { m[h] = -INFINITY; l[h] = 0.f; }
        const char* qb = (const char*)q + (b * H + h0) * W * esz;
        const int64_t len = seq_lens[b];
        for (int64_t t0 = 0; t0 < len && !bad; t0 += MLA_TILE) {
            const int64_t nt = len - t0 < MLA_TILE ? len - t0 : MLA_TILE;
            for (int64_t t = 0; t < nt; t++) {
                const int64_t page = page_table[b * max_pages + (t0 + t) / page_size];
                if (page < 0 || page >= num_pages) { bad = 1; break; }
                lat[t] = (const char*)cache + ((page * page_size + (t0 + t) % page_size) * W) * esz;
            }
            if (bad) break;
            for (int64_t h = 0; h < nh; h++) {  /* (1) scores, (2) one softmax step per head */
                const char* qh = qb + h * W * esz;
                float* ph = p + h * MLA_TILE;
                float tile_max = -INFINITY;
                for (int64_t t = 0; t < nt; t++) {
#if MLA_DP
                    if (simd) ph[t] = dot_bf16_avx512((const uint16_t*)qh, (const uint16_t*)lat[t], W) * scale;
                    else
#endif
                    ph[t] = dot_portable(qh, lat[t], W, bf16) * scale;
                    tile_max = ph[t] > tile_max ? ph[t] : tile_max;
                }
                if (tile_max > m[h]) {  /* a new maximum rescales what is summed so far */
                    const float c = m[h] == -INFINITY ? 0.f : exp_nonpos(m[h] - tile_max);
                    if (c != 1.f) {
                        l[h] *= c;
                        float* a = acc + h * R;
                        for (int64_t r = 0; r < R; r++) a[r] *= c;
                    }
                    m[h] = tile_max;
                }
                float sum = 0.f;
                for (int64_t t = 0; t < nt; t++) { ph[t] = exp_nonpos(ph[t] - m[h]); sum += ph[t]; }
                l[h] += sum;
            }
#if MLA_DP  /* (3) the tile's weighted sum */
            if (simd) weighted_sum_bf16_avx512(acc, p, lat, nh, nt, R);
            else
#endif
            weighted_sum_portable(acc, p, lat, nh, nt, R, bf16);
        }
        for (int64_t h = 0; h < nh; h++) {
            const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
            const int64_t at = (b * H + h0 + h) * R;
            for (int64_t r = 0; r < R; r++) {
                const float v = acc[h * R + r] * inv;
                if (bf16) ((uint16_t*)out)[at + r] = f32_to_bf16(v);
                else ((float*)out)[at + r] = v;
            }
        }
        free(acc);
    }
    return bad ? -1 : 0;
}
