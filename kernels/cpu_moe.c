/* The routed experts of a mixture-of-experts layer in one call, built by cpu_native.py.

   For tokens x [T, H], each routed to K experts (ids [T, K], weights [T, K]):
       out[t] = sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, k]
   with w13 [E, 2 I, H] (expert e's gate rows, then its up rows) and w2 [E, H, I].

   Why: in torch a routed layer is a Python loop over the experts that received tokens, each a
   gather, three small matmuls and an index_add (~10 ops per expert per layer; a decode step of
   one token with 8 experts in 48 layers is ~4000 ops). Here the tokens are grouped by expert
   once (a counting sort of the T * K slots), and two parallel passes stream each selected
   expert's weights once for all of its tokens:
     1. per (expert, block of intermediate rows): act[slot, i] = silu(gate_i . x) * (up_i . x),
        rounded to the model dtype as the torch path rounds each product;
     2. per block of output columns h: out[t, h] += w * (down_h . act[slot]) over the experts in
        order, so that every column's sum has one writer (no atomics) and one fixed order.
   Sums are float32. bf16 operands multiply on AVX-512 BF16 (vdpbf16ps: exact products, float32
   sums) where compiled with it (``moe_isa`` 512); elsewhere, and for float32, plain loops that
   the compiler vectorizes. An id < 0 is a slot routed nowhere here (it adds nothing); an id >= E
   is an error. Under tensor parallelism each rank holds its share of every expert's intermediate
   rows (w13's gate and up rows, w2's columns) and all-reduces ``out`` afterwards. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MOE_DP 1
#else
#define MOE_DP 0
#endif

#define NR 4  /* weight rows per block */
#define NM 4  /* token rows per block */
#define IB 16 /* intermediate indices per task of pass 1 */
#define HB 16 /* output columns per task of pass 2 */

/* 512 where bf16 products run on AVX-512 BF16, else 0 (the portable loops) */
int moe_isa(void) { return MOE_DP ? 512 : 0; }

static inline float ld(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}
static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static float dot_f32(const float* a, const float* b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static float dot_bf16(const uint16_t* a, const uint16_t* b, int64_t n) {
    float s = 0.f;
    for (int64_t i = 0; i < n; i++) s += bf16_to_f32(a[i]) * bf16_to_f32(b[i]);
    return s;
}

#if MOE_DP
/* acc[r][m] = w[r] . x[m] over n bf16 values: 16 float32 accumulators, 32 columns a step */
static void block_dp(const uint16_t* const w[NR], const uint16_t* const x[NM], int64_t n, float acc[NR][NM]) {
    __m512 a[NR][NM];
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < NM; m++) a[r][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 32) {
        const __mmask32 mask = n - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (n - k)) - 1u);
        __m512bh xv[NM];
        for (int m = 0; m < NM; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k);
        for (int r = 0; r < NR; r++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w[r] + k);
            for (int m = 0; m < NM; m++) a[r][m] = _mm512_dpbf16_ps(a[r][m], wv, xv[m]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < NM; m++) acc[r][m] = _mm512_reduce_add_ps(a[r][m]);
}
#endif

/* acc[r][m] = w[r] . x[m] over n values of the model dtype */
static void block(const void* const w[NR], const void* const x[NM], int64_t n, int bf16, float acc[NR][NM]) {
#if MOE_DP
    if (bf16) {
        block_dp((const uint16_t* const*)w, (const uint16_t* const*)x, n, acc);
        return;
    }
#endif
    for (int r = 0; r < NR; r++)
        for (int m = 0; m < NM; m++)
            acc[r][m] = bf16 ? dot_bf16(w[r], x[m], n) : dot_f32(w[r], x[m], n);
}

/* x: [T, H] at row stride x_stride (elements); w13: [E, 2 I, H] and w2: [E, H, I] contiguous;
   ids: [T, K] int32; weights: [T, K] float32; out: [T, H] contiguous; all of the model dtype
   (bf16 != 0: bf16, else float32) but ids and weights. Returns 0, -1 for an id >= E, -2 where
   scratch memory could not be had. */
int moe_experts(const void* x, int64_t x_stride, const void* w13, const void* w2, const int32_t* ids,
                const float* weights, void* out, int T, int K, int E, int64_t H, int64_t I, int bf16) {
    const int64_t S = (int64_t)T * K;
    const size_t esz = bf16 ? 2 : 4;
    for (int64_t s = 0; s < S; s++)
        if (ids[s] >= E) return -1;
    int64_t* start = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t* order = malloc((size_t)(S > 0 ? S : 1) * sizeof(int64_t));
    int* active = malloc((size_t)E * sizeof(int));
    char* act = malloc((size_t)(S > 0 ? S : 1) * (size_t)I * esz);           /* [S, I] by slot */
    float* acc = bf16 ? malloc((size_t)(T > 0 ? T : 1) * (size_t)H * sizeof(float)) : (float*)out;
    if (!start || !order || !active || !act || !acc) {
        free(start); free(order); free(active); free(act);
        if (bf16) free(acc);
        return -2;
    }
    /* counting sort of the slots by expert: expert e's slots are order[start[e] .. start[e + 1]) */
    for (int64_t s = 0; s < S; s++)
        if (ids[s] >= 0) start[ids[s] + 1]++;
    int n_active = 0;
    for (int e = 0; e < E; e++) {
        if (start[e + 1]) active[n_active++] = e;
        start[e + 1] += start[e];
    }
    {
        int64_t* fill = malloc((size_t)E * sizeof(int64_t));
        if (!fill) {
            free(start); free(order); free(active); free(act);
            if (bf16) free(acc);
            return -2;
        }
        memcpy(fill, start, (size_t)E * sizeof(int64_t));
        for (int64_t s = 0; s < S; s++)
            if (ids[s] >= 0) order[fill[ids[s]]++] = s;
        free(fill);
    }

    /* pass 1: act[slot] = silu(gate . x) * (up . x), per (expert, block of IB intermediate indices) */
    const int64_t iblocks = (I + IB - 1) / IB;
    const int64_t tasks1 = (int64_t)n_active * iblocks;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks1; task++) {
        const int e = active[task / iblocks];
        const int64_t i0 = (task % iblocks) * IB, i1 = i0 + IB < I ? i0 + IB : I;
        const char* we = (const char*)w13 + (size_t)e * 2 * I * H * esz;
        for (int64_t j = start[e]; j < start[e + 1]; j += NM) {
            const int nm = start[e + 1] - j < NM ? (int)(start[e + 1] - j) : NM;
            const void* xr[NM];
            for (int m = 0; m < NM; m++)  /* a short group repeats its last row */
                xr[m] = (const char*)x + (size_t)(order[j + (m < nm ? m : nm - 1)] / K) * x_stride * esz;
            for (int64_t i = i0; i < i1; i += 2) {  /* gate i, gate i + 1, up i, up i + 1 */
                const int64_t i2 = i + 1 < i1 ? i + 1 : i;
                const void* wr[NR] = {we + (size_t)i * H * esz, we + (size_t)i2 * H * esz,
                                      we + (size_t)(I + i) * H * esz, we + (size_t)(I + i2) * H * esz};
                float d[NR][NM];
                block(wr, xr, H, bf16, d);
                for (int m = 0; m < nm; m++) {
                    const int64_t slot = order[j + m];
                    for (int p = 0; p < (i2 > i ? 2 : 1); p++) {
                        const float g = rnd(d[p][m], bf16), u = rnd(d[2 + p][m], bf16);
                        const float a = rnd(rnd(silu_nonpos_exp(g), bf16) * u, bf16);
                        const size_t at = (size_t)slot * I + i + p;
                        if (bf16) ((uint16_t*)act)[at] = f32_to_bf16(a);
                        else ((float*)act)[at] = a;
                    }
                }
            }
        }
    }

    /* pass 2: acc[t, h] = sum over t's slots of weight * (down_h . act[slot]), per block of HB columns */
    const int64_t hblocks = (H + HB - 1) / HB;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t hb = 0; hb < hblocks; hb++) {
        const int64_t h0 = hb * HB, h1 = h0 + HB < H ? h0 + HB : H;
        for (int t = 0; t < T; t++)
            for (int64_t h = h0; h < h1; h++) acc[(size_t)t * H + h] = 0.f;
        for (int a = 0; a < n_active; a++) {
            const int e = active[a];
            const char* we = (const char*)w2 + (size_t)e * H * I * esz;
            for (int64_t j = start[e]; j < start[e + 1]; j += NM) {
                const int nm = start[e + 1] - j < NM ? (int)(start[e + 1] - j) : NM;
                const void* ar[NM];
                for (int m = 0; m < NM; m++)
                    ar[m] = act + (size_t)order[j + (m < nm ? m : nm - 1)] * I * esz;
                for (int64_t h = h0; h < h1; h += NR) {
                    const int nr = h1 - h < NR ? (int)(h1 - h) : NR;
                    const void* wr[NR];
                    for (int r = 0; r < NR; r++) wr[r] = we + (size_t)(h + (r < nr ? r : nr - 1)) * I * esz;
                    float d[NR][NM];
                    block(wr, ar, I, bf16, d);
                    for (int m = 0; m < nm; m++) {
                        const int64_t slot = order[j + m];
                        const float w = weights[slot];
                        float* row = acc + (size_t)(slot / K) * H;
                        for (int r = 0; r < nr; r++) row[h + r] += w * rnd(d[r][m], bf16);
                    }
                }
            }
        }
        if (bf16)
            for (int t = 0; t < T; t++)
                for (int64_t h = h0; h < h1; h++)
                    ((uint16_t*)out)[(size_t)t * H + h] = f32_to_bf16(acc[(size_t)t * H + h]);
    }
    free(start); free(order); free(active); free(act);
    if (bf16) free(acc);
    return 0;
}
