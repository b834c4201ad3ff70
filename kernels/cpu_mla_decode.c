/* Weight-absorbed multi-head latent attention decode over latent pages, built by cpu_native.py.

   For decode row b with query q[b] [H, W] (W = kv_lora_rank R + rope dim, the query already in
   latent space) and its first len[b] cached tokens, each one latent vector lat[t] [W] shared by
   every head, stored in pages of ``page_size`` vectors (pool [1, pages, page_size, W]):
       out[b, h, :] = sum_t softmax_t(scale * q[b, h] . lat[t]) * lat[t, :R]

   Why: a head-major MHA kernel reads each head's keys; here every head reads the same vector, so
   one pass over a sequence's tokens serves all of a block of heads while that vector is in
   cache (online softmax per head, float32 running max, sum and R-wide accumulator). The torch
   twin gathers the pages into a padded copy and runs two batched products.
   bf16 dot products run on AVX-512 BF16 (vdpbf16ps: exact products, float32 sums) where compiled
   with it and not ``portable``; otherwise, and for float32, plain loops the compiler vectorizes.
   Rows x head blocks run in parallel. Returns 0, or -1 when a page id is out of range. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MLA_DP 1
#else
#define MLA_DP 0
#endif

#define MLA_HEAD_BLOCK 4

int mla_decode_isa(void) { return MLA_DP ? 512 : 0; }

static inline float mla_ld(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

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

#if MLA_DP
static float dot_bf16_avx512(const uint16_t* a, const uint16_t* b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512bh x = (__m512bh)_mm512_loadu_si512(a + i), y = (__m512bh)_mm512_loadu_si512(b + i);
        acc = _mm512_dpbf16_ps(acc, x, y);
    }
    if (i < n) {
        __mmask32 m = (__mmask32)((1ull << (n - i)) - 1);
        __m512bh x = (__m512bh)_mm512_maskz_loadu_epi16(m, a + i), y = (__m512bh)_mm512_maskz_loadu_epi16(m, b + i);
        acc = _mm512_dpbf16_ps(acc, x, y);
    }
    return _mm512_reduce_add_ps(acc);
}
#endif

int mla_decode(const void* q, const void* cache, const int32_t* page_table, const int32_t* seq_lens, void* out,
               int64_t n, int64_t H, int64_t W, int64_t R, int64_t page_size, int64_t max_pages,
               int64_t num_pages, float scale, int bf16, int portable) {
    const int64_t esz = bf16 ? 2 : 4;
    const int64_t hb = (H + MLA_HEAD_BLOCK - 1) / MLA_HEAD_BLOCK;
    int bad = 0;
    #pragma omp parallel for schedule(dynamic, 1) reduction(|:bad)
    for (int64_t job = 0; job < n * hb; job++) {
        const int64_t b = job / hb, h0 = (job % hb) * MLA_HEAD_BLOCK;
        const int64_t nh = H - h0 < MLA_HEAD_BLOCK ? H - h0 : MLA_HEAD_BLOCK;
        float m[MLA_HEAD_BLOCK], l[MLA_HEAD_BLOCK];
        float* acc = calloc((size_t)(MLA_HEAD_BLOCK * R), sizeof(float));
        for (int64_t h = 0; h < nh; h++) { m[h] = -INFINITY; l[h] = 0.f; }
        const int64_t len = seq_lens[b];
        for (int64_t t = 0; t < len && !bad; t++) {
            const int64_t page = page_table[b * max_pages + t / page_size];
            if (page < 0 || page >= num_pages) { bad = 1; break; }
            const char* lat = (const char*)cache + ((page * page_size + t % page_size) * W) * esz;
            for (int64_t h = 0; h < nh; h++) {
                const char* qh = (const char*)q + ((b * H + h0 + h) * W) * esz;
                float s;
#if MLA_DP
                if (bf16 && !portable) s = dot_bf16_avx512((const uint16_t*)qh, (const uint16_t*)lat, W);
                else
#endif
                s = dot_portable(qh, lat, W, bf16);
                s *= scale;
                float* a = acc + h * R;
                if (s > m[h]) {  /* a new maximum rescales what is summed so far */
                    const float c = m[h] == -INFINITY ? 0.f : expf(m[h] - s);
                    l[h] *= c;
                    for (int64_t r = 0; r < R; r++) a[r] *= c;
                    m[h] = s;
                }
                const float p = expf(s - m[h]);
                l[h] += p;
                if (bf16) { for (int64_t r = 0; r < R; r++) a[r] += p * bf16_to_f32(((const uint16_t*)lat)[r]); }
                else { for (int64_t r = 0; r < R; r++) a[r] += p * ((const float*)lat)[r]; }
            }
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
    (void)mla_ld;
    return bad ? -1 : 0;
}
