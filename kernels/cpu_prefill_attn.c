/* Native causal prefill attention (bf16, AVX-512 BF16), built by cpu_native.py.

   Why: prefill attention is compute-bound, and PyTorch's CPU flash attention runs
   it at a fraction of the matmul rate here (about a third of a 512-token prefill's
   time on the default model). This kernel is flash attention written for
   ``vdpbf16ps``:

   - K and V of each KV head are first repacked into the pair-interleaved layouts
     the instruction reads (K: 16 keys x one (d, d+1) pair per vector; V: 16 dims
     x one (key, key+1) pair per vector), zero-padded to whole 64-key blocks;
   - one OpenMP item per (KV head, 32 query tokens); each takes groups of query
     rows of one head through the key blocks up to its causal limit, with the
     online softmax in float32, P rounded to bf16 for the P.V products (as
     PyTorch's CPU flash attention does), and the output scaled and rounded once;
   - query ``i`` of ``n`` sees keys ``0 .. Lk - n + i``: a cached prefix of
     ``Lk - n`` keys comes first.

   Where the compiler does not target AVX-512 BF16, ``prefill_attn_supported``
   returns 0 and callers keep the torch path. */
#include <stdint.h>
#include <stdlib.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

int prefill_attn_supported(void) { return 1; }

#define PF_KB 64      /* keys per block */
#define PF_QB 32      /* query tokens per work item */

/* exp(x) for x <= 0 (and -inf), 16 lanes: the scalar exp_nonpos of cpu_common.h, vectorized */
static inline __m512 exp512_nonpos(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(0.0013888889f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.008333334f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.041666668f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.16666667f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

static inline __mmask16 lanes_below(int count) {  /* the first `count` lanes, count clamped to [0, 16] */
    return count >= 16 ? (__mmask16)0xFFFF : count <= 0 ? (__mmask16)0 : (__mmask16)((1u << count) - 1u);
}

/* One group of R query rows (consecutive tokens t0.., one head) through keys 0 .. off + t_last, in two
   passes: scores and their row max first (kept in sbuf, [R][Lk64] floats), then exp and P.V block by
   block, so no running max, rescaling or horizontal reduction per block.
   kp: this KV head's packed K [Lk64 / 16][D / 2][16] pairs; vp: packed V [Lk64 / 2][D] pairs. */
#define PF_ROWS(NAME, DV, R)                                                                         \
static void NAME(const uint16_t* q, int64_t q_stride, const uint32_t* kp, const uint32_t* vp,       \
                 uint16_t* out, int64_t out_stride, float* sbuf, int64_t sbuf_stride,               \
                 int t0, int rows, int off, float scale) {                                          \
    enum { NC = DV / 16, NP = DV / 2 };                                                              \
    uint32_t qv[R][NP];                                                                              \
    int seen[R];  /* keys row r sees */                                                              \
    for (int r = 0; r < R; r++) {                                                                    \
        const int t = t0 + (r < rows ? r : rows - 1);  /* a short group repeats its last row */    \
        const uint32_t* src = (const uint32_t*)(q + (int64_t)t * q_stride);                          \
        for (int p = 0; p < NP; p++) qv[r][p] = src[p];                                              \
        seen[r] = off + t + 1;                                                                       \
    }                                                                                                \
    const int nkeys = seen[R - 1];  /* keys the last row sees */                                     \
    __m512 vmax[R];                                                                                  \
    for (int r = 0; r < R; r++) vmax[r] = _mm512_set1_ps(-3.0e38f);                                  \
    for (int k0 = 0; k0 < nkeys; k0 += PF_KB) {                                                      \
        __m512 s[R][4];                                                                              \
        for (int r = 0; r < R; r++)                                                                  \
            for (int c = 0; c < 4; c++) s[r][c] = _mm512_setzero_ps();                               \
        const uint32_t* kb = kp + (int64_t)(k0 / 16) * NP * 16;                                      \
        if (nkeys - k0 >= PF_KB) {                                                                   \
            for (int p = 0; p < NP; p++) {                                                           \
                __m512i kv[4];                                                                       \
                for (int c = 0; c < 4; c++) kv[c] = _mm512_loadu_si512(kb + ((int64_t)c * NP + p) * 16); \
                for (int r = 0; r < R; r++) {                                                        \
                    const __m512i qb = _mm512_set1_epi32((int)qv[r][p]);                             \
                    for (int c = 0; c < 4; c++)                                                      \
                        s[r][c] = _mm512_dpbf16_ps(s[r][c], (__m512bh)qb, (__m512bh)kv[c]);          \
                }                                                                                    \
            }                                                                                        \
        } else {  /* the diagonal block: only the 16-key vectors that hold a key some row sees */   \
            const int nv = (nkeys - k0 + 15) / 16;                                                   \
            for (int p = 0; p < NP; p++) {                                                           \
                for (int c = 0; c < nv; c++) {                                                       \
                    const __m512i kv = _mm512_loadu_si512(kb + ((int64_t)c * NP + p) * 16);         \
                    for (int r = 0; r < R; r++)                                                      \
                        s[r][c] = _mm512_dpbf16_ps(s[r][c], (__m512bh)_mm512_set1_epi32((int)qv[r][p]), (__m512bh)kv); \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++) {                                                                \
            float* sr = sbuf + r * sbuf_stride + k0;                                                 \
            for (int c = 0; c < 4; c++) {                                                            \
                _mm512_storeu_ps(sr + 16 * c, s[r][c]);                                              \
                vmax[r] = _mm512_mask_max_ps(vmax[r], lanes_below(seen[r] - k0 - 16 * c), vmax[r], s[r][c]); \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    __m512 mv[R], l[R], acc[R][NC];  /* l: the softmax denominator, summed lane-wise until the end */ \
    const __m512 sc = _mm512_set1_ps(scale);                                                         \
    for (int r = 0; r < R; r++) {  /* scale > 0: the max of raw scores, scaled once */               \
        mv[r] = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[r]) * scale);                               \
        l[r] = _mm512_setzero_ps();                                                                  \
        for (int c = 0; c < NC; c++) acc[r][c] = _mm512_setzero_ps();                                \
    }                                                                                                \
    uint16_t pb[R][PF_KB] __attribute__((aligned(64)));                                              \
    for (int k0 = 0; k0 < nkeys; k0 += PF_KB) {                                                      \
        for (int r = 0; r < R; r++) {                                                                \
            const float* sr = sbuf + r * sbuf_stride + k0;                                           \
            __m512 p[4];                                                                             \
            for (int c = 0; c < 4; c++) {                                                            \
                const __mmask16 mk = lanes_below(seen[r] - k0 - 16 * c);                             \
                p[c] = _mm512_maskz_mov_ps(mk, exp512_nonpos(_mm512_fmsub_ps(_mm512_loadu_ps(sr + 16 * c), sc, mv[r]))); \
                l[r] = _mm512_add_ps(l[r], p[c]);                                                    \
            }                                                                                        \
            _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));                     \
            _mm512_store_si512(pb[r] + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));                \
        }                                                                                            \
        const int pairs = (nkeys - k0 < PF_KB ? nkeys - k0 + 1 : PF_KB) / 2;                         \
        const uint32_t* vb = vp + (int64_t)(k0 / 2) * DV;                                            \
        for (int jp = 0; jp < pairs; jp++) {                                                         \
            __m512i vv[NC];                                                                          \
            for (int c = 0; c < NC; c++) vv[c] = _mm512_loadu_si512(vb + (int64_t)jp * DV + 16 * c); \
            for (int r = 0; r < R; r++) {                                                            \
                const __m512i pv = _mm512_set1_epi32((int)((const uint32_t*)pb[r])[jp]);             \
                for (int c = 0; c < NC; c++)                                                         \
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)pv, (__m512bh)vv[c]);          \
            }                                                                                        \
        }                                                                                            \
    }                                                                                                \
    for (int r = 0; r < rows; r++) {                                                                 \
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));                         \
        uint16_t* dst = out + (int64_t)(t0 + r) * out_stride;                                        \
        for (int c = 0; c < NC; c++)                                                                 \
            _mm256_storeu_si256((__m256i*)(dst + 16 * c),                                            \
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], inv)));         \
    }                                                                                                \
}

PF_ROWS(pf_rows_d64, 64, 4)
PF_ROWS(pf_rows_d128, 128, 2)

/* q: [n, H, D] rows at q_stride elements; k, v: [., KVH, D] rows at k_stride / v_stride and heads at
   kh_stride / vh_stride (D for new K/V, a plane for the page pool's slots), key j in row
   key_rows[j] (the page pool's slots, read in place), or in row j where key_rows is NULL;
   out: [n, H * D] rows at out_stride; kp, vp: scratch of KVH * ceil(Lk / 64) * 64 * D elements each.
   Query i attends keys 0 .. Lk - n + i. Returns 0, or -1 for an unsupported shape. */
int prefill_attn_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
                      int64_t kh_stride, const uint16_t* v, int64_t v_stride, int64_t vh_stride,
                      const int64_t* key_rows, uint16_t* out,
                      int64_t out_stride, uint16_t* kp, uint16_t* vp, int n, int Lk, int H, int KVH, int D,
                      float scale) {
    if ((D != 64 && D != 128) || n < 1 || Lk < n || H % KVH != 0) return -1;
    const int G = H / KVH, NP = D / 2, off = Lk - n;
    const int Lk64 = (Lk + PF_KB - 1) / PF_KB * PF_KB;
    const int nq = (n + PF_QB - 1) / PF_QB;
    uint32_t* kp32 = (uint32_t*)kp;
    uint32_t* vp32 = (uint32_t*)vp;
    int failed = 0;
    #pragma omp parallel
    {
        /* K: [h][key / 16][pair][key % 16]; V: [h][key / 2][d] as (key, key + 1) pairs */
        #pragma omp for collapse(2) schedule(static)
        for (int h = 0; h < KVH; h++) {
            for (int j16 = 0; j16 < Lk64 / 16; j16++) {
                uint32_t* kd = kp32 + ((int64_t)h * (Lk64 / 16) + j16) * NP * 16;
                for (int jj = 0; jj < 16; jj++) {
                    const int j = j16 * 16 + jj;
                    if (j >= Lk) { for (int p = 0; p < NP; p++) kd[p * 16 + jj] = 0u; continue; }
                    const int64_t row = key_rows ? key_rows[j] : j;
                    const uint32_t* ks = (const uint32_t*)(k + row * k_stride + (int64_t)h * kh_stride);
                    for (int p = 0; p < NP; p++) kd[p * 16 + jj] = ks[p];
                }
                uint16_t* vd = vp + ((int64_t)h * (Lk64 / 2) + j16 * 8) * D * 2;
                for (int jp = 0; jp < 8; jp++) {
                    const int j = j16 * 16 + 2 * jp;  /* keys j and j + 1: the two halves of each pair */
                    const uint16_t* v0 = j < Lk ? v + (key_rows ? key_rows[j] : j) * v_stride + (int64_t)h * vh_stride : 0;
                    const uint16_t* v1 = j + 1 < Lk ? v + (key_rows ? key_rows[j + 1] : j + 1) * v_stride
                                                       + (int64_t)h * vh_stride : 0;
                    for (int d = 0; d < D; d++) {
                        vd[((int64_t)jp * D + d) * 2] = v0 ? v0[d] : 0;
                        vd[((int64_t)jp * D + d) * 2 + 1] = v1 ? v1[d] : 0;
                    }
                }
            }
        }
        /* the implicit barrier above: every packed key is in place */
        /* per thread: the score rows of one group, [4][Lk64] floats (R <= 4) */
        float* sbuf = (float*)aligned_alloc(64, sizeof(float) * 4 * (size_t)Lk64);
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int h = 0; h < KVH; h++) {
            for (int qb = nq - 1; qb >= 0; qb--) {  /* the longest (last) blocks first */
                if (!sbuf) { failed = 1; continue; }
                const uint32_t* kph = kp32 + (int64_t)h * Lk64 * NP;
                const uint32_t* vph = vp32 + (int64_t)h * (Lk64 / 2) * D;
                const int t_end = (qb + 1) * PF_QB < n ? (qb + 1) * PF_QB : n;
                for (int g = 0; g < G; g++) {
                    const int head = h * G + g;
                    const uint16_t* qh = q + (int64_t)head * D;
                    uint16_t* oh = out + (int64_t)head * D;
                    const int R = D == 64 ? 4 : 2;
                    for (int t0 = qb * PF_QB; t0 < t_end; t0 += R) {
                        const int rows = t_end - t0 < R ? t_end - t0 : R;
                        if (D == 64) pf_rows_d64(qh, q_stride, kph, vph, oh, out_stride, sbuf, Lk64, t0, rows, off, scale);
                        else pf_rows_d128(qh, q_stride, kph, vph, oh, out_stride, sbuf, Lk64, t0, rows, off, scale);
                    }
                }
            }
        }
        free(sbuf);
    }
    return failed ? -2 : 0;
}
#else
int prefill_attn_supported(void) { return 0; }
int prefill_attn_bf16(const void* q, int64_t a, const void* k, int64_t b, int64_t kh, const void* v,
                      int64_t c, int64_t vh, const void* key_rows, void* out, int64_t d, void* kp, void* vp, int n, int Lk, int H,
                      int KVH, int D, float scale) { return -1; }
#endif
