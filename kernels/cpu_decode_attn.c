/* Paged decode attention, built by cpu_native.py.

   Why: paged decode attention is memory-bound (each step reads every cached K/V
   once), but in plain torch it must first gather pages into a padded block and
   then run tiny batched matmuls, which costs several times the bytes it reads.
   This kernel walks each sequence's pages in place with an online-free two-pass
   softmax in float32, one OpenMP task per (sequence, kv head).

   Scores of bf16 caches with head_dim 64 or 128 (the specialised versions) come 16 keys at a
   time from AVX-512 BF16 dot products (``qk16_bf16``): q . k multiplied exactly and summed in
   float32, and the 16 keys' partial sums reduced together (45 shuffles and adds) rather than one
   horizontal reduction per key and head, which was most of the kernel's time. The weighted sum
   of V takes two keys per dot product (``pv_bf16``). 64 sequences x 1024 tokens, one Zen 4
   core: 12 -> 18-19 GB/s of K/V read on contiguous pages, 4.2 -> 6 on pages in random order
   (where the ~9 GB/s this machine reads random 2 KB blocks at bounds it; prefetching the next
   page measured no gain). */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define QK16_OK 1
#else
#define QK16_OK 0
#endif

#define MAX_GROUP 32
#define MAX_DIM 256

static inline float ld_bf16(const uint16_t* p, int i) { return bf16_to_f32(p[i]); }
static inline float ld_f32(const float* p, int i) { return p[i]; }
static inline void st_bf16(uint16_t* p, int i, float v) { p[i] = f32_to_bf16(v); }
static inline void st_f32(float* p, int i, float v) { p[i] = v; }

#if QK16_OK
/* lane i of the result: the sum of v[i]'s 16 lanes */
static inline __m512 hsum16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane j: [a_4j+a_4j+2, b_.., a_4j+1+a_4j+3, b_..] */
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane j: the 4 inputs' sums over lanes 4j..4j+3 */
        const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++)  /* the 128-bit lanes pairwise: [x0 l0+l1, x0 l2+l3, x1 l0+l1, x1 l2+l3] */
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
}

/* s[l] = scale * (qg . k_l) for the nk <= 16 keys at kp + l * tok_stride (nk >= 1); returns their max.
   D (a multiple of 32) is a literal where it is inlined. */
static inline __attribute__((always_inline)) float qk16_bf16(const uint16_t* qg, const uint16_t* kp,
                                                             int64_t tok_stride, int nk, const int D,
                                                             float scale, float* s) {
    __m512 acc[16];
    for (int o = 0; o < 16; o++) {
        const uint16_t* kr = kp + (int64_t)(o < nk ? o : nk - 1) * tok_stride;
        __m512 a = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 32)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(kr + d), (__m512bh)_mm512_loadu_si512(qg + d));
        acc[o] = a;
    }
    const __mmask16 valid = nk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nk) - 1u);
    const __m512 sc = _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(s, valid, sc);
    return _mm512_mask_reduce_max_ps(valid, sc);
}

/* acc[g * astride + ...] += sum over the nv keys at vp (+ l * tok_stride) of p[g * L + l] * v_l, for
   g < G: two keys per bf16 dot product, each weight rounded to bf16 as GPU flash attention rounds
   P before its second product (the normaliser stays the float32 sum). The 32 dims of each chunk
   land in acc in unpack order (``pv_dim``); an odd last key is paired with weight 0. */
static inline __attribute__((always_inline)) void pv_bf16(const float* p, int64_t L, int G, const uint16_t* vp,
                                                          int64_t tok_stride, int nv, const int D, float* acc,
                                                          int64_t astride) {
    for (int o = 0; o < nv; o += 2) {
        const uint16_t* v0 = vp + (int64_t)o * tok_stride;
        const uint16_t* v1 = o + 1 < nv ? v0 + tok_stride : v0;
        __m512i lo[MAX_DIM / 32], hi[MAX_DIM / 32];
        for (int c = 0; c < D / 32; c++) {
            const __m512i a = _mm512_loadu_si512(v0 + 32 * c), b = _mm512_loadu_si512(v1 + 32 * c);
            lo[c] = _mm512_unpacklo_epi16(a, b);
            hi[c] = _mm512_unpackhi_epi16(a, b);
        }
        for (int g = 0; g < G; g++) {
            const uint32_t w0 = f32_to_bf16(p[g * L + o]);
            const uint32_t w1 = o + 1 < nv ? f32_to_bf16(p[g * L + o + 1]) : 0u;
            const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)(w0 | w1 << 16));
            float* ag = acc + g * astride;
            for (int c = 0; c < D / 32; c++) {
                _mm512_storeu_ps(ag + 32 * c, _mm512_dpbf16_ps(_mm512_loadu_ps(ag + 32 * c), (__m512bh)lo[c], pw));
                _mm512_storeu_ps(ag + 32 * c + 16,
                                 _mm512_dpbf16_ps(_mm512_loadu_ps(ag + 32 * c + 16), (__m512bh)hi[c], pw));
            }
        }
    }
}
#define QK16(qg, kp, tok_stride, nk, D, scale, s) qk16_bf16(qg, kp, tok_stride, nk, D, scale, s)
#define PV(p, L, G, vp, tok_stride, nv, D, acc, astride) pv_bf16(p, L, G, vp, tok_stride, nv, D, acc, astride)
#else
#define QK16(qg, kp, tok_stride, nk, D, scale, s) 0.f
#define PV(p, L, G, vp, tok_stride, nv, D, acc, astride) (void)0
#endif

/* where pv_bf16 leaves dim d: per 32-dim chunk, unpacklo's dims (4 of each 8) then unpackhi's */
static inline int pv_dim(int d) {
    const int e = d % 32, j = e / 8, r = e % 8;
    return d - e + (r < 4 ? 4 * j + r : 16 + 4 * j + r - 4);
}

/* q: [n, ., D] rows of H heads at q_stride elements per token; caches: key o of page p of KV head h
   at h * head_stride + p * page_stride + o * tok_stride elements (the pool's head-major
   [KVH, pages, ps, D]: ps * D * pages, ps * D, D); page_table: [n, pt_stride] int32;
   seq_lens: [n] int32; out: [n, H, D] contiguous. */
#define DECODE_ATTN(NAME, T, LD, ST, DIMV, FAST)                                                        \
int NAME(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,                   \
         int64_t head_stride, int64_t page_stride, int64_t tok_stride,                        \
         const int32_t* page_table, int64_t pt_stride, const int32_t* seq_lens, T* out,       \
         int n, int H, int KVH, int D, int ps, float scale) {                                 \
    const int G = H / KVH;                                                                    \
    if (G > MAX_GROUP || D > MAX_DIM || D != (DIMV)) return -1;                                              \
    int failed = 0;                                                                           \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                          \
    for (int64_t item = 0; item < (int64_t)n * KVH; item++) {                                 \
        const int b = (int)(item / KVH), h = (int)(item % KVH);                               \
        const int L = seq_lens[b];                                                            \
        const int32_t* pages = page_table + (int64_t)b * pt_stride;                           \
        float qf[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], kf[MAX_DIM];                   \
        float mx[MAX_GROUP], sum[MAX_GROUP];                                                  \
        float* s = (float*)malloc(sizeof(float) * (size_t)G * (size_t)(L > 0 ? L : 1));       \
        if (!s) { failed = 1; continue; }                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            const T* qp = q + (int64_t)b * q_stride + (int64_t)(h * G + g) * DIMV;               \
            if (!FAST) /* the scalar scores' scaled float q; qk16_bf16 reads q as it is */   \
                for (int d = 0; d < DIMV; d++) qf[g][d] = LD(qp, d) * scale;                     \
            mx[g] = -3.0e38f; sum[g] = 0.f;                                                  \
            for (int d = 0; d < DIMV; d++) acc[g][d] = 0.f;                                      \
        }                                                                                     \
        /* pages outer, offsets inner: no division per key */                                \
        for (int l0 = 0, pi = 0; l0 < L; l0 += ps, pi++) {                                    \
          const T* kbase = k_cache + (int64_t)h * head_stride + (int64_t)pages[pi] * page_stride; \
          const int nk = L - l0 < ps ? L - l0 : ps;                                           \
          if (FAST) {                                                                         \
            for (int o0 = 0; o0 < nk; o0 += 16)                                               \
              for (int g = 0; g < G; g++) {                                                   \
                const T* qg = q + (int64_t)b * q_stride + (int64_t)(h * G + g) * DIMV;        \
                const float m = QK16((const uint16_t*)qg, (const uint16_t*)(kbase + (int64_t)o0 * tok_stride), \
                                     tok_stride, nk - o0 < 16 ? nk - o0 : 16, DIMV, scale, s + g * L + l0 + o0); \
                if (m > mx[g]) mx[g] = m;                                                     \
              }                                                                               \
            continue;                                                                         \
          }                                                                                   \
          for (int o = 0; o < nk; o++) {                                                      \
            const int l = l0 + o;                                                             \
            const T* kp = kbase + (int64_t)o * tok_stride;                                    \
            for (int d = 0; d < DIMV; d++) kf[d] = LD(kp, d);                                    \
            for (int g = 0; g < G; g++) {                                                     \
                float dot = 0.f;                                                              \
                _Pragma("omp simd reduction(+:dot)")                                          \
                for (int d = 0; d < DIMV; d++) dot += qf[g][d] * kf[d];                          \
                s[g * L + l] = dot;                                                           \
                if (dot > mx[g]) mx[g] = dot;                                                 \
            }                                                                                 \
          }                                                                                   \
        }                                                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            float t = 0.f, m = mx[g], *sg = s + (int64_t)g * L;                               \
            _Pragma("omp simd reduction(+:t)")                                                \
            for (int l = 0; l < L; l++) { float e = exp_nonpos(sg[l] - m); sg[l] = e; t += e; } \
            sum[g] = t;                                                                       \
        }                                                                                     \
        for (int l0 = 0, pi = 0; l0 < L; l0 += ps, pi++) {                                    \
          const T* vbase = v_cache + (int64_t)h * head_stride + (int64_t)pages[pi] * page_stride; \
          const int nv = L - l0 < ps ? L - l0 : ps;                                           \
          if (FAST) {                                                                         \
            PV(s + l0, L, G, (const uint16_t*)vbase, tok_stride, nv, DIMV, &acc[0][0], MAX_DIM); \
            continue;                                                                         \
          }                                                                                   \
          for (int o = 0; o < nv; o++) {                                                      \
            const int l = l0 + o;                                                             \
            const T* vp = vbase + (int64_t)o * tok_stride;                                    \
            for (int d = 0; d < DIMV; d++) kf[d] = LD(vp, d);                                    \
            for (int g = 0; g < G; g++) {                                                     \
                const float w = s[g * L + l];                                                 \
                _Pragma("omp simd")                                                           \
                for (int d = 0; d < DIMV; d++) acc[g][d] += w * kf[d];                           \
            }                                                                                 \
          }                                                                                   \
        }                                                                                     \
        for (int g = 0; g < G; g++) {                                                         \
            T* op = out + ((int64_t)b * H + h * G + g) * DIMV;                                   \
            const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;                              \
            for (int d = 0; d < DIMV; d++) ST(op, d, acc[g][FAST ? pv_dim(d) : d] * inv);        \
        }                                                                                     \
        free(s);                                                                              \
    }                                                                                         \
    return failed ? -2 : 0;                                                                   \
}

/* head_dim as a compile-time constant lets the compiler keep rows in registers and unroll */
DECODE_ATTN(decode_attn_bf16, uint16_t, ld_bf16, st_bf16, D, 0)
DECODE_ATTN(decode_attn_f32, float, ld_f32, st_f32, D, 0)
DECODE_ATTN(decode_attn_bf16_d64, uint16_t, ld_bf16, st_bf16, 64, QK16_OK)
DECODE_ATTN(decode_attn_f32_d64, float, ld_f32, st_f32, 64, 0)
DECODE_ATTN(decode_attn_bf16_d128, uint16_t, ld_bf16, st_bf16, 128, QK16_OK)
DECODE_ATTN(decode_attn_f32_d128, float, ld_f32, st_f32, 128, 0)
