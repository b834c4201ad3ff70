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
   MLA_REG_COLS columns at a time in registers, so each latent value is loaded and widened once per
   register block and no accumulator is stored per token. The torch twin gathers the pages into a
   padded copy and runs two batched products.
   bf16 runs on AVX-512 BF16 (scores with vdpbf16ps: exact products, float32 sums; the weighted
   sum in float32 FMA) where compiled with it and not ``portable``; otherwise, and for float32,
   plain loops of the same tiles that the compiler vectorizes. Jobs (rows x head blocks) run in
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

/* 16 bf16 values (masked) widened to float32 */
static inline __m512 load16_bf16(const uint16_t* x, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x)), 16));
}

/* weighted_sum_portable for bf16 latents: a block of MLA_REG_HEADS heads x MLA_REG_COLS columns
   accumulates in 16 registers over the tile's tokens */
static void weighted_sum_bf16_avx512(float* acc, const float* p, const char* const* lat, int64_t nh, int64_t nt,
                                     int64_t R) {
    for (int64_t h0 = 0; h0 < nh; h0 += MLA_REG_HEADS) {
        const int64_t bh = nh - h0 < MLA_REG_HEADS ? nh - h0 : MLA_REG_HEADS;
        for (int64_t r0 = 0; r0 < R; r0 += MLA_REG_COLS) {
            __mmask16 m[4];
            for (int j = 0; j < 4; j++) {
                const int64_t left = R - r0 - 16 * j;
                m[j] = left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
            }
            __m512 a[MLA_REG_HEADS][4];
            for (int64_t h = 0; h < MLA_REG_HEADS; h++)
                for (int j = 0; j < 4; j++)
                    a[h][j] = h < bh ? _mm512_maskz_loadu_ps(m[j], acc + (h0 + h) * R + r0 + 16 * j) : _mm512_setzero_ps();
            for (int64_t t = 0; t < nt; t++) {
                const uint16_t* x = (const uint16_t*)lat[t] + r0;
                const __m512 v0 = load16_bf16(x, m[0]), v1 = load16_bf16(x + 16, m[1]),
                             v2 = load16_bf16(x + 32, m[2]), v3 = load16_bf16(x + 48, m[3]);
                for (int64_t h = 0; h < MLA_REG_HEADS; h++) {
                    const __m512 w = _mm512_set1_ps(h < bh ? p[(h0 + h) * MLA_TILE + t] : 0.f);
                    a[h][0] = _mm512_fmadd_ps(w, v0, a[h][0]);
                    a[h][1] = _mm512_fmadd_ps(w, v1, a[h][1]);
                    a[h][2] = _mm512_fmadd_ps(w, v2, a[h][2]);
                    a[h][3] = _mm512_fmadd_ps(w, v3, a[h][3]);
                }
            }
            for (int64_t h = 0; h < bh; h++)
                for (int j = 0; j < 4; j++) _mm512_mask_storeu_ps(acc + (h0 + h) * R + r0 + 16 * j, m[j], a[h][j]);
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
