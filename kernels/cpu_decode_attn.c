/* Paged decode attention, built by cpu_native.py.

   Why: paged decode attention is memory-bound (each step reads every cached K/V
   once), but in plain torch it must first gather pages into a padded block and
   then run tiny batched matmuls, which costs several times the bytes it reads.
   This kernel walks each sequence's pages in place with an online-free two-pass
   softmax in float32, one OpenMP task per (sequence, kv head). */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"

#define MAX_GROUP 32
#define MAX_DIM 256

static inline float ld_bf16(const uint16_t* p, int i) { return bf16_to_f32(p[i]); }
static inline float ld_f32(const float* p, int i) { return p[i]; }
static inline void st_bf16(uint16_t* p, int i, float v) { p[i] = f32_to_bf16(v); }
static inline void st_f32(float* p, int i, float v) { p[i] = v; }

/* q: [n, ., D] rows of H heads at q_stride elements per token; caches: key o of page p of KV head h
   at h * head_stride + p * page_stride + o * tok_stride elements (the pool's head-major
   [KVH, pages, ps, D]: ps * D * pages, ps * D, D); page_table: [n, pt_stride] int32;
   seq_lens: [n] int32; out: [n, H, D] contiguous. */
#define DECODE_ATTN(NAME, T, LD, ST, DIMV)                                                        \
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
            for (int d = 0; d < DIMV; d++) qf[g][d] = LD(qp, d) * scale;                         \
            mx[g] = -3.0e38f; sum[g] = 0.f;                                                  \
            for (int d = 0; d < DIMV; d++) acc[g][d] = 0.f;                                      \
        }                                                                                     \
        /* pages outer, offsets inner: no division per key */                                \
        for (int l0 = 0, pi = 0; l0 < L; l0 += ps, pi++) {                                    \
          const T* kbase = k_cache + (int64_t)h * head_stride + (int64_t)pages[pi] * page_stride; \
          const int nk = L - l0 < ps ? L - l0 : ps;                                           \
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
            for (int d = 0; d < DIMV; d++) ST(op, d, acc[g][d] * inv);                           \
        }                                                                                     \
        free(s);                                                                              \
    }                                                                                         \
    return failed ? -2 : 0;                                                                   \
}

/* head_dim as a compile-time constant lets the compiler keep rows in registers and unroll */
DECODE_ATTN(decode_attn_bf16, uint16_t, ld_bf16, st_bf16, D)
DECODE_ATTN(decode_attn_f32, float, ld_f32, st_f32, D)
DECODE_ATTN(decode_attn_bf16_d64, uint16_t, ld_bf16, st_bf16, 64)
DECODE_ATTN(decode_attn_f32_d64, float, ld_f32, st_f32, 64)
DECODE_ATTN(decode_attn_bf16_d128, uint16_t, ld_bf16, st_bf16, 128)
DECODE_ATTN(decode_attn_f32_d128, float, ld_f32, st_f32, 128)
