/* w8a8's int8 products on AMX, with their scaling fused: out = epilogue(q[M, K] @ W[N, K]^T), built
   by cpu_native.py where the CPU has AMX-INT8 (``amx_int8_supported``).

   Why: on a CPU with AMX, oneDNN's bf16 products run on AMX-BF16, and ``torch._int_mm`` (which
   multiplied w8a8's int8 before this) does not run on AMX-INT8: on Emerald Rapids it took 26 ms
   at 4096 x 576 x 3072 against bf16's 6.3, so w8a8's prefill was 0.65-0.74x bf16's there.
   ``tdpbssd`` multiplies int8 at twice AMX-BF16's rate.

   The weights are packed once (``amx_layout.AmxInt8Weight``) as the B operand of ``tdpbssd``:
   blocks of 32 output columns (two 16-column tiles), each block K / 64 steps of 2 KB, a step's
   tile t holding its 16 columns' 64 values as [16 (k / 4)][16 columns][4 (k % 4)]. A SwiGLU
   weight's block is 16 gate columns (tile 0) and the same 16 up columns (tile 1), so a block
   gives 16 finished outputs. q (the activations, per-token int8 from quant_rows_s8) is read in
   place as the A operand: rows at q_stride, padded with zero columns to a multiple of 64 and
   with zero rows to a multiple of 32.

   One block is 32 rows x 32 columns in 4 accumulator tiles; per K step 2 A tiles and 2 B tiles
   feed 4 tdpbssd. The column blocks go in groups whose weights stay in L2 (``GROUP_BYTES``); the
   threads share a group's 32-row blocks, and each passes its rows over the whole group, so its
   output rows are written left to right (a column strip at a time, 32 rows apart, measured
   slower: 10.7 against 18 ms at 4096 x 576 x 3072 on one thread). Each finished block's int32
   sums are scaled at once, from L1: the arithmetic of cpu_int8_act.c's int8_epilogue_bf16, value
   for value (outliers joined in slot order, then the scales, the residual or SwiGLU, one
   rounding), its outliers' weights read from the packed bytes. */
#include <stdint.h>
#include <omp.h>

#include "cpu_common.h"

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#include "cpu_amx.h"
#include "cpu_bf16_avx512.h"
#define AMX_OK 1
#else
#define AMX_OK 0
#endif

/* 1 where the CPU runs AMX-INT8 and Linux lets this process use its tiles */
int amx_int8_supported(void) {
#if AMX_OK
    return amx_permitted();
#else
    return 0;
#endif
}

#if AMX_OK

#define ROWS 32       /* activation rows a block (two A tiles of 16; amx_layout.ROWS) */
#define COLS 32       /* output columns a block (two B tiles of 16; amx_layout.COLS) */
#define KSTEP 64      /* int8 columns of K a tile holds (amx_layout.KSTEP) */
#define STEP_BYTES (2 * TILE_BYTES)  /* a block's two B tiles of one K step */
#define GROUP_BYTES (1 << 20)  /* the packed weights of a group of column blocks: they stay in L2 */

typedef struct {
    const int8_t* q;
    int64_t qs;
    const float* a_scale;
    const int8_t* W;
    const float* w_scale;
    uint16_t* out;
    int64_t os;
    const uint16_t* res;
    int64_t rs;
    int M, N, steps, mode;
    const int32_t* o_idx;
    const float* o_val;
    const int32_t* o_cnt;
    int P;
} amx_args;

/* one tile's 16 columns of row m in float: sums * a_scale plus the row's outliers, each times
   its weights, read from the block's packed bytes (column k of tile t: byte k % 4 of each
   dword of its 64-byte row k % 64 / 4, sign-extended in place) */
static inline __m512 tile_sums(const amx_args* a, const int32_t* c, const int8_t* B, int t, int m) {
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c)), _mm512_set1_ps(a->a_scale[m]));
    const int cnt = a->o_cnt ? a->o_cnt[m] : 0;
    for (int p = 0; p < cnt; p++) {
        const int k = a->o_idx[(int64_t)m * a->P + p];
        const __m512i w = _mm512_loadu_si512(B + (int64_t)(k / KSTEP) * STEP_BYTES + t * TILE_BYTES + (k % KSTEP) / 4 * 64);
        const __m512i w32 = _mm512_srai_epi32(_mm512_sll_epi32(w, _mm_cvtsi32_si128(24 - 8 * (k % 4))), 24);
        v = _mm512_fmadd_ps(_mm512_set1_ps(a->o_val[(int64_t)m * a->P + p]), _mm512_cvtepi32_ps(w32), v);
    }
    return v;
}

/* block nb's scaled outputs for rows m0..m0+ROWS-1 (those below M), from its sums c */
static void block_epilogue(const amx_args* a, const int32_t c[ROWS][COLS], const int8_t* B, int m0, int nb) {
    const int rows = a->M - m0 < ROWS ? a->M - m0 : ROWS;
    for (int r = 0; r < rows; r++) {
        const int m = m0 + r;
        uint16_t* o = a->out + (int64_t)m * a->os;
        if (a->mode == 2) {  /* tile 0: gate columns i0.., tile 1: the same up columns */
            const int I = a->N / 2, i0 = nb * 16;
            const __mmask16 mask = lanes16(I - i0);
            const __m512 g = _mm512_mul_ps(tile_sums(a, c[r], B, 0, m), _mm512_maskz_loadu_ps(mask, a->w_scale + i0));
            const __m512 gate = widen_bf16(round_bf16(silu16(g)));
            const __m512 u = _mm512_mul_ps(tile_sums(a, c[r] + 16, B, 1, m),
                                           _mm512_maskz_loadu_ps(mask, a->w_scale + I + i0));
            _mm256_mask_storeu_epi16(o + i0, mask, round_bf16(_mm512_mul_ps(u, gate)));
            continue;
        }
        for (int t = 0; t < 2; t++) {
            const int n0 = nb * COLS + 16 * t;
            if (n0 >= a->N) break;
            const __mmask16 mask = lanes16(a->N - n0);
            const __m512 ws = _mm512_maskz_loadu_ps(mask, a->w_scale + n0);
            __m512 v = tile_sums(a, c[r] + 16 * t, B, t, m);
            if (a->mode == 1)
                v = _mm512_fmadd_ps(v, ws, widen_bf16(_mm256_maskz_loadu_epi16(mask, a->res + (int64_t)m * a->rs + n0)));
            else
                v = _mm512_mul_ps(v, ws);
            _mm256_mask_storeu_epi16(o + n0, mask, round_bf16(v));
        }
    }
}

/* rows m0..m0+ROWS-1 against column block nb: 4 accumulator tiles (0-3), A in 4-5, B in 6-7 */
static void block(const amx_args* a, int m0, int nb) {
    const int8_t* B = a->W + (int64_t)nb * a->steps * STEP_BYTES;
    const int8_t* A = a->q + (int64_t)m0 * a->qs;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int s = 0; s < a->steps; s++) {
        _tile_loadd(4, A + s * KSTEP, a->qs);
        _tile_loadd(5, A + 16 * a->qs + s * KSTEP, a->qs);
        _tile_loadd(6, B + (int64_t)s * STEP_BYTES, 64);
        _tile_loadd(7, B + (int64_t)s * STEP_BYTES + TILE_BYTES, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
    }
    int32_t c[ROWS][COLS] __attribute__((aligned(64)));
    _tile_stored(0, &c[0][0], COLS * 4);
    _tile_stored(1, &c[0][16], COLS * 4);
    _tile_stored(2, &c[16][0], COLS * 4);
    _tile_stored(3, &c[16][16], COLS * 4);
    block_epilogue(a, c, B, m0, nb);
}

#endif

/* q: [ceil32(M), ceil64(K)] int8 rows at q_stride (zero padded), a_scale [M]; W: packed
   (AmxInt8Weight; as SwiGLU for mode 2), w_scale [N]; out: [M, N or N / 2] bf16 rows at
   out_stride; res: [M, N] bf16 rows at res_stride (mode 1). Modes and outliers as
   int8_epilogue_bf16's (o_cnt null: none). Returns 0, or -1 without AMX-INT8. */
int amx_int8_linear_bf16(const int8_t* q, int64_t q_stride, const float* a_scale, const int8_t* W,
                         const float* w_scale, uint16_t* out, int64_t out_stride, const uint16_t* res,
                         int64_t res_stride, int M, int N, int K, int mode, const int32_t* o_idx,
                         const float* o_val, const int32_t* o_cnt, int P) {
#if AMX_OK
    const amx_args a = {q, q_stride, a_scale, W, w_scale, out, out_stride, res, res_stride, M, N,
                        (K + KSTEP - 1) / KSTEP, mode, o_idx, o_val, o_cnt, P};
    const int blocks = mode == 2 ? (N / 2 + 15) / 16 : (N + COLS - 1) / COLS;
    const int row_blocks = (M + ROWS - 1) / ROWS;
    int group = (int)(GROUP_BYTES / ((int64_t)a.steps * STEP_BYTES));
    group = group < 1 ? 1 : group;
    #pragma omp parallel
    {
        amx_tiles_on();
        for (int g0 = 0; g0 < blocks; g0 += group) {
            const int g1 = g0 + group < blocks ? g0 + group : blocks;
            #pragma omp for schedule(static)
            for (int mb = 0; mb < row_blocks; mb++)
                for (int nb = g0; nb < g1; nb++) block(&a, mb * ROWS, nb);
        }
        _tile_release();
    }
    return 0;
#else
    return -1;
#endif
}
