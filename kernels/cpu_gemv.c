/* Skinny matrix products for the decode step: out[M, N] = x[M, K] @ W[N, K]^T with M small
   (a decode batch of a few sequences), W bf16 or int8 with per-output-channel float32 scales,
   packed as gemv_layout.py describes (GemvWeight). Built by cpu_native.py.

   At M = 1 a decode step is a stream over the weights, and a product's only job is to keep
   up with memory. oneDNN's prepacked bf16 linear reads W at about 13 GB/s on one Zen 4 core
   where a plain sum over the same bytes reads 25-29 GB/s (scripts/profile_decode_step.py,
   lm_head_*). These loops stream W once, as one sequential run (the packed layout), with every
   x row held in L1, at the plain read's rate. The block kernels come in two instruction sets,
   chosen at compile time (``gemv_isa``):

   - AVX-512 BF16, VBMI and VNNI (cpu_gemv_avx512.h; Zen 4, Sapphire Rapids and later): bf16 dot
     products (vdpbf16ps); the LM head at one row 35 GB/s against a sum's 34 (Zen 4, load 3.5);
     the same loops over row-major W read 10-21 GB/s (4 short row streams, prefetched or not).
     int8 is sign-extended to int16 from memory and multiplied in integers (vpdpwssd) against x
     in 16-bit fixed point: the default model's w8a16 step at one row 8.7-9.2 ms at 2 threads
     where widening int8 to bf16 by byte lookups took 10.5-10.9 (Emerald Rapids; 16.0-16.6
     against 21.0 at one thread, there the read's rate). torch's ``_weight_int8pack_mm`` reads
     int8 at ~6 GB/s on Zen 4. From 3 rows of x on, the dot products (~1.1 ns each on Zen 4), not
     memory, set the time.
   - AVX2 and FMA (cpu_gemv_avx2.h; Haswell, Zen 1-3): both operands widened to float32 in
     registers, float32 FMAs. Without it such CPUs ran every linear through oneDNN (bf16 without
     native bf16 instructions) and w8a16 dequantized every matrix in torch at every step.

   Output rows are split across OpenMP threads in blocks of 4; each block runs over every x
   row, so W is read from memory once per call whatever M is. Sums are float32 over 32-column
   chunks in column order, reduced once per row, rounded to bf16 once at the end as oneDNN
   rounds. Epilogues (``mode``), as the model's oneDNN post-ops do them:
     0: out = bf16(acc)
     1: out = bf16(acc + res)                      the residual add fused into o and down
     2: W is [2 I, K] = gate | up (packed as SwiGLU) and out is [M, I]:
        out = bf16(acc_up * bf16(silu(acc_gate)))
   int8 weights carry one scale per row, or (Q8_0, ``blocked``) one per row and 32-column chunk,
   which then multiplies that chunk's dot products before they join the row's sums.
   Returns 0, or -1 where neither instruction set is there (``gemv_isa`` 0; the model's
   products then go through oneDNN). */
#include <stdint.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define RB 4   /* W rows per block (gemv_layout.ROWS) */
#define MB 4   /* x rows per pass */
#define CW 32  /* columns per chunk (gemv_layout.CHUNK) */

/* x rows as an instruction set's int8 blocks take them, filled by its xq_init: per x row
   ``row_elems`` int16 of x in fixed point and the row's scale s (x ~= value * s) */
typedef struct {
    int16_t* v;
    float* scale;
    int64_t row_elems;
} xq_rows;

static inline int xq_alloc(xq_rows* xq, int M, int64_t row_elems) {
    xq->row_elems = row_elems;
    xq->v = malloc((size_t)M * row_elems * sizeof(int16_t));
    xq->scale = malloc((size_t)M * sizeof(float));
    if (!xq->v || !xq->scale) {
        free(xq->v);
        free(xq->scale);
        return -1;
    }
    return 0;
}
static inline void xq_free(xq_rows* xq) {
    free(xq->v);
    free(xq->scale);
}
static inline float xq_scale(const xq_rows* xq, int m) { return xq->scale[m]; }

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include "cpu_bf16_avx512.h"
#include "cpu_gemv_avx512.h"
#define GEMV_ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "cpu_gemv_avx2.h"
#define GEMV_ISA 2
#else
#define GEMV_ISA 0
#endif
#define GEMV_OK (GEMV_ISA != 0)

/* which block kernels were compiled: 512 (AVX-512 BF16, VBMI and VNNI), 2 (AVX2 and FMA) or 0 (none,
   and every entry point returns -1) */
int gemv_isa(void) { return GEMV_ISA; }

#if GEMV_OK

static inline float silu_f(float g) { return g / (1.f + expf(-g)); }

/* Store one block's sums acc[r][m] (output rows n0 + r of x rows m0 + m) through the epilogue. */
static inline void store_block(float acc[RB][MB], int n0, int rows, int m0, int mrows, const float* scale,
                               uint16_t* out, int64_t out_stride, const uint16_t* res, int64_t res_stride,
                               int mode, int inter, float gate[RB][MB]) {
    for (int r = 0; r < rows; r++) {
        const float s = scale ? scale[n0 + r] : 1.f;
        for (int m = 0; m < mrows; m++) {
            float v = acc[r][m] * s;
            const int64_t row = m0 + m;
            if (mode == 2) {
                /* n0 is the first up row here; its gate row is n0 - inter */
                const float g = bf16_to_f32(f32_to_bf16(silu_f(gate[r][m] * (scale ? scale[n0 + r - inter] : 1.f))));
                v = v * g;
                out[row * out_stride + (n0 - inter) + r] = f32_to_bf16(v);
            } else {
                if (mode == 1) v += bf16_to_f32(res[row * res_stride + n0 + r]);
                out[row * out_stride + n0 + r] = f32_to_bf16(v);
            }
        }
    }
}

/* one block for either weight type and any mrows in 1..MB, each case with a literal MR;
   ``block`` is the block's index in 32-column chunks of RB rows from the start of W; ``cs``: its
   rows' chunk scales (Q8_0), or null */
static void block_any(const uint16_t* Wb, const int8_t* W8, int64_t K, int64_t block, const uint16_t* x,
                      int64_t x_stride, const xq_rows* xq, int m0, int mrows, float acc[RB][MB],
                      const float* const cs[RB]) {
    const int64_t at = block * ((K + CW - 1) / CW) * RB * CW;
#define BLOCK_CASE(MR) case MR: \
        if (W8) block_i8(W8 + at, K, xq, m0, MR, acc, cs); \
        else block_bf16(Wb + at, K, x, x_stride, m0, MR, acc); \
        break;
    switch (mrows) { BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4) }
#undef BLOCK_CASE
    if (W8)  /* int8 sums come in units of each x row's scale where the kernels quantized x */
        for (int m = 0; m < mrows; m++) {
            const float s = xq_scale(xq, m0 + m);
            for (int r = 0; r < RB; r++) acc[r][m] *= s;
        }
}

/* Q8_0: the chunk scales of output rows row0.. of ``rows`` (scale: [N, chunks]); a padding row
   past N takes row0's, its weights being zero */
static inline void chunk_scales(const float* scale, int64_t chunks, int64_t row0, int rows, const float* cs[RB]) {
    for (int r = 0; r < RB; r++) cs[r] = scale + (row0 + (r < rows ? r : 0)) * chunks;
}

/* One driver for both weight types: ``W8`` non-null selects int8 (with ``scale``). */
static int gemv_run(const uint16_t* x, int64_t x_stride, const uint16_t* Wb, const int8_t* W8, const float* scale,
                    int blocked, uint16_t* out, int64_t out_stride, const uint16_t* res, int64_t res_stride,
                    int M, int N, int K, int mode) {
    const int64_t chunks = (K + CW - 1) / CW;
    /* the epilogue scales per row; Q8_0's scales were applied per chunk */
    const float* row_scale = blocked ? 0 : scale;
    /* mode 2: blocks over the I = N / 2 gate rows, each followed in W by its up rows' block */
    const int rows_out = mode == 2 ? N / 2 : N;
    const int nblocks = (rows_out + RB - 1) / RB;
    /* int8: x rows as the instruction set's int8 blocks take them, once for every block */
    xq_rows xq;
    memset(&xq, 0, sizeof xq);
    if (W8 && xq_init(&xq, x, x_stride, M, K) != 0) return -2;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        const int n0 = b * RB;
        const int rows = rows_out - n0 < RB ? rows_out - n0 : RB;
        /* Q8_0: this block's rows' chunk scales (the gate rows' for mode 2, then the up rows') */
        const float *cs[RB], *cs_up[RB];
        if (blocked) {
            chunk_scales(scale, chunks, n0, rows, cs);
            if (mode == 2) chunk_scales(scale, chunks, n0 + rows_out, rows, cs_up);
        }
        for (int m0 = 0; m0 < M; m0 += MB) {
            const int mrows = M - m0 < MB ? M - m0 : MB;
            float acc[RB][MB], gate[RB][MB];
            if (mode == 2) {
                block_any(Wb, W8, K, 2 * (int64_t)b, x, x_stride, &xq, m0, mrows, gate, blocked ? cs : 0);
                block_any(Wb, W8, K, 2 * (int64_t)b + 1, x, x_stride, &xq, m0, mrows, acc, blocked ? cs_up : 0);
                store_block(acc, n0 + rows_out, rows, m0, mrows, row_scale, out, out_stride, res, res_stride, mode,
                            rows_out, gate);
            } else {
                block_any(Wb, W8, K, b, x, x_stride, &xq, m0, mrows, acc, blocked ? cs : 0);
                store_block(acc, n0, rows, m0, mrows, row_scale, out, out_stride, res, res_stride, mode, 0, gate);
            }
        }
    }
    xq_free(&xq);
    return 0;
}

#endif

/* x: [M, K] bf16 rows at x_stride; W: [N, K] bf16 packed (GemvWeight, as SwiGLU for mode 2);
   out: [M, N or N/2] bf16 rows at out_stride; res: [M, N] bf16 rows at res_stride (mode 1 only) */
int gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* W, uint16_t* out, int64_t out_stride,
              const uint16_t* res, int64_t res_stride, int M, int N, int K, int mode) {
#if GEMV_OK
    return gemv_run(x, x_stride, W, 0, 0, 0, out, out_stride, res, res_stride, M, N, K, mode);
#else
    return -1;
#endif
}

/* As gemv_bf16 with W: [N, K] int8 packed and scale: [N] float32 (row n's weights are W[n] * scale[n]);
   ``blocked`` (Q8_0): scale is [N, ceil(K / 32)], one per row and 32-column chunk */
int gemv_w8_bf16(const uint16_t* x, int64_t x_stride, const int8_t* W, const float* scale, int blocked,
                 uint16_t* out, int64_t out_stride, const uint16_t* res, int64_t res_stride, int M, int N, int K,
                 int mode) {
#if GEMV_OK
    return gemv_run(x, x_stride, 0, W, scale, blocked, out, out_stride, res, res_stride, M, N, K, mode);
#else
    return -1;
#endif
}

/* Dequantize a packed int8 W (N, K, ``swiglu`` as packed) to out: [N, K] bf16 row-major, each
   weight bf16(q * scale[n]) (``blocked``: q * scale[n][k / 32]) as
   ``quantization.Int8Weight.dequantize`` rounds it (exact q, one
   float32 product, round to nearest even): the larger steps' dense form of the int8 weights
   gemv streams (dequantize_block); -1 where gemv is not supported. */
int gemv_w8_dequantize(const int8_t* W, const float* scale, int blocked, int N, int K, int swiglu, uint16_t* out) {
#if GEMV_OK
    const int halves = swiglu ? 2 : 1, rows_out = N / halves;
    const int nblocks = (rows_out + RB - 1) / RB;
    const int64_t chunks = (K + CW - 1) / CW;
    #pragma omp parallel for schedule(static)
    for (int b = 0; b < nblocks; b++)
        dequantize_block(W, scale, blocked, rows_out, K, halves, chunks, b, out, K, rows_out, 0);
    return 0;
#else
    return -1;
#endif
}

/* ---- The int8 weights' larger steps on AMX-BF16 ---------------------------------------------

   w8a16 keeps only gemv's packed int8. A step past gemv's rows used to dequantize each matrix to
   bf16 in memory and multiply it with torch's linear (unprepacked): the default model's step of
   64 sequences wrote and read back 270 MB of bf16 weights, and took twice bf16's time. Here each
   thread widens 32 output rows at a time into a scratch that stays in L1/L2 and multiplies them
   there on AMX-BF16 tiles: q itself, exact in bf16, with the row's scale applied to the sums as
   gemv applies it (Q8_0's per-block scales go into the weights, dequantize_block's bf16(q * s)).
   The weights are the A operand (their rows are the scratch's rows) and x is B, packed once per call as
   tdpbf16ps takes it: [16 column pairs][16 tokens][2] per K step of 32. So the sums come out
   transposed (output rows by tokens), and each 16 x 16 tile is transposed in registers on its
   way through the epilogue (mode, out_f32 as cpu_gemm.c's; SwiGLU's silu cpu_common.h's). The tokens
   go in blocks of AMX_TOKENS that stay in L2 (a weight row group is dequantized once per block);
   K is padded to a multiple of 32 with zeros in the scratch and in x's packing. */

#if GEMV_ISA == 512 && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "cpu_amx.h"
#define W8_AMX 1
#else
#define W8_AMX 0
#endif

/* 1 where gemv_w8_amx_linear runs: AMX-BF16 compiled in and the tiles permitted */
int gemv_w8_amx(void) {
#if W8_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

#if W8_AMX

#define AMX_TOKENS 256  /* x rows per block: a block's packed x (<= 256 x K bf16) stays in L2 */

/* t[r][c] -> t[c][r] of a 16 x 16 float32 tile in 16 registers */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    /* now r[4i + j] holds rows 4i..4i+3's column j, 4 + j, 8 + j, 12 + j (a 128-bit lane each) */
    for (int j = 0; j < 4; j++) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);       /* lanes 0, 2 of rows 0-3, 4-7 */
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);   /* lanes 1, 3 */
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
    }
}

/* x rows 0..T-1 ([., K] bf16 at xs) as B tiles: the tile of K step s and tokens 16 tb.. at
   xp + (s * nt + tb) * 512 holds token i's columns 32 s + 2 j, + 1 at [j][i][2] (a 16 x 16
   transpose of the 16 tokens' column pairs), zeros past K and T */
static void pack_x(const uint16_t* x, int64_t xs, int T, int64_t K, int64_t steps, int nt, uint16_t* xp) {
    #pragma omp for schedule(static)
    for (int64_t it = 0; it < steps * nt; it++) {
        const int64_t s = it / nt;
        const int tb = (int)(it % nt);
        const __mmask32 cols = chunk_mask(s * 32, K);
        __m512 r[16];
        for (int i = 0; i < 16; i++) {
            const int m = tb * 16 + i;
            r[i] = m < T ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(cols, x + (int64_t)m * xs + s * 32))
                         : _mm512_setzero_ps();
        }
        transpose16(r);
        uint16_t* tile = xp + it / nt * nt * 512 + (int64_t)tb * 512;
        for (int j = 0; j < 16; j++) _mm512_store_ps((float*)(tile + 32 * j), r[j]);
    }
}

typedef struct {
    void* out;  /* bf16, or float32 (out_f32) */
    int64_t os;
    const uint16_t* res;
    int64_t rs;
    const float* scale;  /* per output row (the up rows after the gate rows for SwiGLU), or null */
    int mode, out_f32, out_cols;
} w8_epilogue;

/* sums c[a][b] (weight rows 16 a.., tokens 16 b..) of output columns n0.. for tokens m0.. (those
   below end): out through the epilogue; SwiGLU: c[0] gate, c[1] up of the same 16 columns */
static void w8_epilogue_tiles(const w8_epilogue* e, float c[2][2][16][16], int n0, int m0, int end) {
    for (int b = 0; b < 2; b++) {
        __m512 t[2][16];
        for (int a = 0; a < 2; a++) {
            for (int i = 0; i < 16; i++) t[a][i] = _mm512_load_ps(c[a][b][i]);
            transpose16(t[a]);  /* t[a][token]: 16 weight rows */
        }
        for (int i = 0; i < 16; i++) {
            const int m = m0 + 16 * b + i;
            if (m >= end) return;
            const int64_t row = (int64_t)m * e->os;
            if (e->mode == 2) {
                const __mmask16 mask = lanes16(e->out_cols - n0);
                __m512 g = t[0][i], u = t[1][i];
                if (e->scale) {
                    g = _mm512_mul_ps(g, _mm512_maskz_loadu_ps(mask, e->scale + n0));
                    u = _mm512_mul_ps(u, _mm512_maskz_loadu_ps(mask, e->scale + e->out_cols + n0));
                }
                const __m512 gate = widen_bf16(round_bf16(silu16(g)));
                store16(e->out, row + n0, _mm512_mul_ps(u, gate), e->out_cols - n0, e->out_f32);
                continue;
            }
            for (int a = 0; a < 2; a++) {
                const int n = n0 + 16 * a, cnt = e->out_cols - n;
                if (cnt <= 0) break;
                __m512 v = t[a][i];
                if (e->scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(lanes16(cnt), e->scale + n));
                if (e->mode == 1)
                    v = _mm512_add_ps(v, widen_bf16(_mm256_maskz_loadu_epi16(lanes16(cnt), e->res + (int64_t)m * e->rs + n)));
                store16(e->out, row + n, v, cnt, e->out_f32);
            }
        }
    }
}

#endif

/* x: [M, K] bf16 rows at x_stride; W, scale, blocked: a packed int8 weight as gemv_w8_bf16 takes
   it ([N, K], SwiGLU for mode 2); out: [M, N or N / 2] rows at out_stride, bf16 or (out_f32)
   float32 holding bf16-rounded values; res: [M, N] bf16 (mode 1). Any M (meant for more rows
   than gemv's). Returns 0, -1 without AMX-BF16, -3 when out of memory. */
int gemv_w8_amx_linear(const uint16_t* x, int64_t x_stride, const int8_t* W, const float* scale, int blocked,
                       void* out, int64_t out_stride, const uint16_t* res, int64_t res_stride, int M, int N, int K,
                       int mode, int out_f32) {
#if W8_AMX
    const int swiglu = mode == 2, halves = swiglu ? 2 : 1;
    const int rows_out = N / halves;
    const int64_t chunks = (K + CW - 1) / CW, steps = chunks, Kp = chunks * CW;
    /* a group: 32 weight rows, SwiGLU's 16 gate and the same 16 up rows (4 or 8 gemv blocks) */
    const int group_rows = swiglu ? 16 : 32, groups = (rows_out + group_rows - 1) / group_rows;
    const int nt_max = (AMX_TOKENS + 31) / 32 * 2;
    const int threads = omp_get_max_threads();
    uint16_t* xp = aligned_alloc(64, (size_t)steps * nt_max * 512 * 2);
    /* per thread: its group's dequantized rows, K padded with zeros, and the group's sums */
    uint16_t* wr_all = calloc((size_t)threads * 32 * Kp, 2);
    float* c_all = aligned_alloc(64, sizeof(float) * threads * 4 * 256);
    if (!xp || !wr_all || !c_all) {
        free(xp);
        free(wr_all);
        free(c_all);
        return -3;
    }
    /* per-row scales join the sums at the end; Q8_0's per-block scales go into the weights */
    const w8_epilogue e = {out, out_stride, res, res_stride, blocked ? NULL : scale, mode, out_f32,
                           rows_out};
    #pragma omp parallel
    {
        uint16_t* wr = wr_all + (int64_t)omp_get_thread_num() * 32 * Kp;
        float (*c)[2][16][16] = (float (*)[2][16][16])(c_all + omp_get_thread_num() * 4 * 256);
        amx_tiles_on();
        for (int t0 = 0; t0 < M; t0 += AMX_TOKENS) {
            const int T = M - t0 < AMX_TOKENS ? M - t0 : AMX_TOKENS;
            const int nt = (T + 31) / 32 * 2;  /* token tiles, in pairs */
            pack_x(x + (int64_t)t0 * x_stride, x_stride, T, K, steps, nt, xp);  /* omp for: a barrier after */
            #pragma omp for schedule(static)
            for (int g = 0; g < groups; g++) {
                const int b0 = g * group_rows / RB, b1 = (g + 1) * group_rows / RB;
                const int nblocks = (rows_out + RB - 1) / RB;
                /* per-row scales: q itself here, the scale on the sums in the epilogue */
                for (int b = b0; b < b1 && b < nblocks; b++)
                    dequantize_block(W, blocked ? scale : NULL, blocked, rows_out, K, halves, chunks, b, wr, Kp,
                                     16, (int64_t)b0 * RB);
                for (int tb = 0; tb < nt; tb += 2) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t s = 0; s < steps; s++) {
                        _tile_loadd(4, wr + s * 32, Kp * 2);
                        _tile_loadd(5, wr + 16 * Kp + s * 32, Kp * 2);
                        _tile_loadd(6, xp + (s * nt + tb) * 512, 64);
                        _tile_loadd(7, xp + (s * nt + tb + 1) * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, c[0][0], 64);
                    _tile_stored(1, c[0][1], 64);
                    _tile_stored(2, c[1][0], 64);
                    _tile_stored(3, c[1][1], 64);
                    w8_epilogue_tiles(&e, c, g * group_rows, t0 + tb * 16, t0 + T);
                }
            }
        }
        _tile_release();
    }
    free(xp);
    free(wr_all);
    free(c_all);
    return 0;
#else
    (void)x; (void)x_stride; (void)W; (void)scale; (void)blocked; (void)out; (void)out_stride; (void)res;
    (void)res_stride; (void)M; (void)N; (void)K; (void)mode; (void)out_f32;
    return -1;
#endif
}
