/* The segmented LoRA product of a batch whose rows use different adapters (or none), built by
   cpu_native.py.

   For each row t on slot s = row_slot[t] >= 0 (a row at -1 is the base model's, untouched):
       h = A[s] x[t]              (shrink: parts * rank values, one per row of A)
       y[t, n] += Bt[s][:, n] . h[part(n) * rank ...]   (expand, the slot's scaling in Bt)
   with every part of a merged linear (q | k | v, gate | up) stacked in A, so one shrink of
   x serves them all, and y rounded to bf16 once after the delta is added in float32.

   Why: the torch forms cost either two small products per slot and part (a Python loop) or, for
   a mix of adapters, two products over every slot's columns with each row masked to its own (at 8
   adapters about half the base product's flops for 2% of useful work). Here the rows are sorted
   by slot (a counting sort, SGLang's segments), each segment cut into groups of up to four rows
   that share every load of their slot's A and B, and the threads take the groups; the work is
   that of the rows that use an adapter and nothing else.

   bf16 operands multiply on AVX-512 BF16 (vdpbf16ps: exact products, float32 sums) where
   compiled with it (``lora_isa`` 512); elsewhere plain loops that the compiler vectorizes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"
#include "cpu_lora.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define LORA_DP 1
#else
#define LORA_DP 0
#endif

#define G 4  /* rows of one slot taken together: each load of A and B serves all of them */

/* 512 where bf16 products run on AVX-512 BF16, else 0 (the portable loops) */
int lora_isa(void) { return LORA_DP ? 512 : 0; }

#if LORA_DP
#include "cpu_bf16_avx512.h"

static inline __mmask32 lanes32(int64_t cnt) {
    return cnt >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << cnt) - 1u);
}

/* h[m][j] = a[j] . x[m] over n bf16 values, for j < rows and m < g: four rows of A a step */
static void shrink(const uint16_t* a, const uint16_t* const x[G], int g, int64_t n, int rows, float h[G][LORA_MAX_H]) {
    int j = 0;
    for (; j + 4 <= rows; j += 4) {
        __m512 acc[4][G];
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < G; m++) acc[r][m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < n; k += 32) {
            const __mmask32 mask = lanes32(n - k);
            __m512bh xv[G];
            for (int m = 0; m < g; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k);
            for (int r = 0; r < 4; r++) {
                const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + (j + r) * n + k);
                for (int m = 0; m < g; m++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
            }
        }
        for (int r = 0; r < 4; r++)
            for (int m = 0; m < g; m++) h[m][j + r] = _mm512_reduce_add_ps(acc[r][m]);
    }
    for (; j < rows; j++) {
        __m512 acc[G];
        for (int m = 0; m < G; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t k = 0; k < n; k += 32) {
            const __mmask32 mask = lanes32(n - k);
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + j * n + k);
            for (int m = 0; m < g; m++)
                acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x[m] + k));
        }
        for (int m = 0; m < g; m++) h[m][j] = _mm512_reduce_add_ps(acc[m]);
    }
}

/* y[m][c0, c1) = bf16(y + sum_j h[m][off + j] bt[j][.]) over ``rank`` rows of bt (row stride n) */
static void expand(const uint16_t* bt, int64_t n, float h[G][LORA_MAX_H], int64_t off, int g, int rank, int64_t c0,
                   int64_t c1, uint16_t* const y[G]) {
    for (int64_t c = c0; c < c1; c += 16) {
        const int cnt = c1 - c < 16 ? (int)(c1 - c) : 16;
        const __mmask16 mask = lanes16(cnt);
        __m512 acc[G];
        for (int m = 0; m < g; m++) acc[m] = widen_bf16(_mm256_maskz_loadu_epi16(mask, y[m] + c));
        for (int j = 0; j < rank; j++) {
            const __m512 b = widen_bf16(_mm256_maskz_loadu_epi16(mask, bt + j * n + c));
            for (int m = 0; m < g; m++) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(h[m][off + j]), b, acc[m]);
        }
        for (int m = 0; m < g; m++) store16(y[m], c, acc[m], cnt, 0);
    }
}
#else
static void shrink(const uint16_t* a, const uint16_t* const x[G], int g, int64_t n, int rows, float h[G][LORA_MAX_H]) {
    for (int j = 0; j < rows; j++) {
        const uint16_t* aj = a + j * n;
        for (int m = 0; m < g; m++) {
            float s = 0.f;
            for (int64_t k = 0; k < n; k++) s += bf16_to_f32(aj[k]) * bf16_to_f32(x[m][k]);
            h[m][j] = s;
        }
    }
}

#define COLS 256  /* output columns per pass */
static void expand(const uint16_t* bt, int64_t n, float h[G][LORA_MAX_H], int64_t off, int g, int rank, int64_t c0,
                   int64_t c1, uint16_t* const y[G]) {
    float acc[COLS];
    for (int m = 0; m < g; m++)
        for (int64_t c = c0; c < c1; c += COLS) {
            const int64_t w = c1 - c < COLS ? c1 - c : COLS;
            for (int64_t i = 0; i < w; i++) acc[i] = bf16_to_f32(y[m][c + i]);
            for (int j = 0; j < rank; j++) {
                const float hj = h[m][off + j];
                const uint16_t* b = bt + j * n + c;
                for (int64_t i = 0; i < w; i++) acc[i] += hj * bf16_to_f32(b[i]);
            }
            for (int64_t i = 0; i < w; i++) y[m][c + i] = f32_to_bf16(acc[i]);
        }
}
#endif

/* Rows t < M of x [M, in] (row stride x_stride) and y [M, out] (row stride y_stride), bf16.
   Returns 0; -1 for a slot at or past w->slots; -2 for a shape past the limits of cpu_lora.h;
   -3 where memory for the row order is not to be had. */
int lora_add_bf16(const lora_weights* w, const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t y_stride,
                  const int32_t* row_slot, int M) {
    const int64_t S = w->slots, P = w->parts, R = w->rank, K = w->in, N = w->out;
    if (P < 1 || P > LORA_MAX_PARTS || P * R > LORA_MAX_H || R < 1 || w->part_end[P - 1] != N) return -2;
    int64_t counts[S + 1];
    memset(counts, 0, sizeof(counts));
    int n = 0;
    for (int t = 0; t < M; t++) {
        const int32_t s = row_slot[t];
        if (s >= S) return -1;
        if (s >= 0) { counts[s + 1]++; n++; }
    }
    if (n == 0) return 0;
    int* order = malloc((size_t)n * sizeof(int));  /* the rows by slot: each slot's segment in turn */
    if (!order) return -3;
    for (int64_t s = 0; s < S; s++) counts[s + 1] += counts[s];
    for (int t = 0; t < M; t++)
        if (row_slot[t] >= 0) order[counts[row_slot[t]]++] = t;
    /* groups of up to G consecutive rows of one slot (a segment cut into groups) */
    int* group = malloc((size_t)(n + 1) * sizeof(int));
    if (!group) { free(order); return -3; }
    int groups = 0;
    for (int i = 0; i < n; i++)
        if (i == 0 || row_slot[order[i]] != row_slot[order[i - 1]] || i - group[groups - 1] == G) group[groups++] = i;
    group[groups] = n;
    #pragma omp parallel for schedule(static)
    for (int q = 0; q < groups; q++) {
        const int i0 = group[q], g = group[q + 1] - i0;
        const int64_t s = row_slot[order[i0]];
        const uint16_t* xs[G];
        uint16_t* ys[G];
        for (int m = 0; m < g; m++) {
            xs[m] = x + order[i0 + m] * x_stride;
            ys[m] = y + order[i0 + m] * y_stride;
        }
        float h[G][LORA_MAX_H];
        shrink(w->a + s * P * R * K, xs, g, K, (int)(P * R), h);
        const uint16_t* bt = w->bt + s * R * N;
        int64_t c0 = 0;
        for (int64_t p = 0; p < P; p++) {
            expand(bt, N, h, p * R, g, (int)R, c0, w->part_end[p], ys);
            c0 = w->part_end[p];
        }
    }
    free(group);
    free(order);
    return 0;
}
