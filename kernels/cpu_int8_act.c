/* The two passes around an int8 x int8 product for w8a8 prefill, built by cpu_native.py.

   A large step's linear under ``w8a8`` quantizes its bf16 activations per token (symmetric
   absmax), multiplies them with the per-channel int8 weights into int32 (``torch._int_mm``,
   oneDNN's VNNI kernel), and scales the sums back: out[m, n] = acc[m, n] * a_scale[m] * w_scale[n].
   In torch ops each side is 4-5 elementwise passes with their temporaries; at 4096 tokens on the
   default model they took 38 ms of the 72 ms the int8 products take (one Zen 4 core), so the
   int8 path was no faster than bf16. One pass each here. Plain loops that the compiler
   vectorizes; no instruction-set requirement. */
#include <stdint.h>

#include "cpu_common.h"

#define OQ 32  /* columns per block of the outlier search */

/* a row's values over thr, the first P in column order, into idx / val (*cnt of them); returns
   the largest |x| of the rest. Block by block: only a block whose largest |x| is over thr is
   searched value by value. */
static float take_outliers(const uint16_t* xr, int K, float thr, int P, int32_t* idx, float* val, int* cnt) {
    float amax = 0.f;
    int c = 0;
    for (int k0 = 0; k0 < K; k0 += OQ) {
        const int n = K - k0 < OQ ? K - k0 : OQ;
        float mx = 0.f;
        #pragma omp simd reduction(max:mx)
        for (int i = 0; i < n; i++) {
            const float v = fabsf(bf16_to_f32(xr[k0 + i]));
            mx = v > mx ? v : mx;
        }
        if (mx <= thr || c == P) {
            amax = mx > amax ? mx : amax;
            continue;
        }
        for (int k = k0; k < k0 + n; k++) {
            const float xv = bf16_to_f32(xr[k]), v = fabsf(xv);
            if (v > thr && c < P) {
                idx[c] = k;
                val[c] = xv;
                c++;
            } else if (v > amax) {
                amax = v;
            }
        }
    }
    *cnt = c;
    return amax;
}

/* x: [M, K] bf16 rows at x_stride -> q: [M, K] int8 rows at q_stride, scale: [M] with
   x[m, k] ~= q[m, k] * scale[m]; scale = max|x[m]| / 127 (0 for an all-zero row, whose q is 0).

   Outliers (tau > 0): a value with |x| > tau * mean|x[m]| is kept out of the int8 row (q 0, and
   not in its absmax) and returned exactly: o_idx[m, p] its column, o_val[m, p] its value, o_cnt[m]
   how many, the first P of the row in column order (any further ones stay in the int8 row). One
   such value sets the row's absmax, so without this every other value of the row keeps only the
   few int8 steps below it (LLM.int8()'s observation; here per token, so a token's result does not
   depend on the rest of its batch). */
int quant_rows_s8(const uint16_t* x, int64_t x_stride, int8_t* q, int64_t q_stride, float* scale, int M, int K,
                  float tau, int P, int32_t* o_idx, float* o_val, int32_t* o_cnt) {
    #pragma omp parallel for schedule(static) if (M >= 64)
    for (int m = 0; m < M; m++) {
        const uint16_t* xr = x + (int64_t)m * x_stride;
        int8_t* qr = q + (int64_t)m * q_stride;
        /* the row's sum of |x| and largest |x| in one pass */
        float sum = 0.f, amax = 0.f;
        #pragma omp simd reduction(max:amax) reduction(+:sum)
        for (int k = 0; k < K; k++) {
            const float v = fabsf(bf16_to_f32(xr[k]));
            amax = v > amax ? v : amax;
            sum += v;
        }
        const float thr = tau * sum / (float)K;
        int cnt = 0;
        if (tau > 0.f && amax > thr)  /* a row with outliers: collect them, absmax of the rest */
            amax = take_outliers(xr, K, thr, P, o_idx + (int64_t)m * P, o_val + (int64_t)m * P, &cnt);
        if (o_cnt) o_cnt[m] = cnt;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        scale[m] = amax / 127.f;
        #pragma omp simd
        for (int k = 0; k < K; k++) {
            float v = rintf(bf16_to_f32(xr[k]) * inv);  /* nearest, ties to even, as torch.round */
            v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
            qr[k] = (int8_t)v;
        }
        for (int p = 0; p < cnt; p++) qr[o_idx[(int64_t)m * P + p]] = 0;
    }
    return 0;
}

/* row m's sums in float for columns n0..n0+len-1 (len <= OB): acc * a_scale plus its outliers'
   products with the int8 weights, in units of w_scale: wt is W transposed, [K, N] int8 contiguous,
   so an outlier's column of W is a row here */
#define OB 256
static inline void row_sums(const int32_t* a, float s, const int8_t* wt, int N, const int32_t* idx,
                            const float* val, int cnt, int n0, int len, float t[OB]) {
    #pragma omp simd
    for (int i = 0; i < len; i++) t[i] = (float)a[n0 + i] * s;
    for (int p = 0; p < cnt; p++) {
        const int8_t* wr = wt + (int64_t)idx[p] * N + n0;
        const float v = val[p];
        #pragma omp simd
        for (int i = 0; i < len; i++) t[i] += v * (float)wr[i];
    }
}

/* acc: [M, N] int32 contiguous; a_scale: [M]; w_scale: [N]; out rows at out_stride. mode:
     0: out[m, n] = bf16(acc * a_scale[m] * w_scale[n]), [M, N];
     1: the same plus res[m, n] (bf16, rows at res_stride) before the one rounding, as oneDNN's add;
     2: the columns are gate | up (N = 2 I) and out is [M, I]: bf16(up * bf16(silu(gate))), the
        rounding of the bf16 path's fused swish and mul post-ops.
   o_cnt non-null: quant_rows_s8's outliers (P slots a row) join the sums before the scaling,
   multiplied with wt ([K, N]: the int8 weights transposed); the same results bit for bit where a
   row has none. */
int int8_epilogue_bf16(const int32_t* acc, const float* a_scale, const float* w_scale, uint16_t* out,
                       int64_t out_stride, const uint16_t* res, int64_t res_stride, int M, int N, int mode,
                       const int8_t* wt, const int32_t* o_idx, const float* o_val, const int32_t* o_cnt, int P) {
    const int I = N / 2;
    #pragma omp parallel for schedule(static) if (M >= 64)
    for (int m = 0; m < M; m++) {
        const int32_t* a = acc + (int64_t)m * N;
        uint16_t* o = out + (int64_t)m * out_stride;
        const float s = a_scale[m];
        const int cnt = o_cnt ? o_cnt[m] : 0;
        const int32_t* idx = cnt ? o_idx + (int64_t)m * P : 0;
        const float* val = cnt ? o_val + (int64_t)m * P : 0;
        float g[OB], u[OB];
        if (mode == 2) {
            for (int i0 = 0; i0 < I; i0 += OB) {
                const int len = I - i0 < OB ? I - i0 : OB;
                row_sums(a, s, wt, N, idx, val, cnt, i0, len, g);
                row_sums(a, s, wt, N, idx, val, cnt, I + i0, len, u);
                #pragma omp simd
                for (int i = 0; i < len; i++) {
                    const float gate = bf16_to_f32(f32_to_bf16(silu_nonpos_exp(g[i] * w_scale[i0 + i])));
                    o[i0 + i] = f32_to_bf16(u[i] * w_scale[I + i0 + i] * gate);
                }
            }
            continue;
        }
        const uint16_t* r = mode == 1 ? res + (int64_t)m * res_stride : 0;
        for (int n0 = 0; n0 < N; n0 += OB) {
            const int len = N - n0 < OB ? N - n0 : OB;
            row_sums(a, s, wt, N, idx, val, cnt, n0, len, u);
            if (r) {
                #pragma omp simd
                for (int i = 0; i < len; i++) o[n0 + i] = f32_to_bf16(u[i] * w_scale[n0 + i] + bf16_to_f32(r[n0 + i]));
            } else {
                #pragma omp simd
                for (int i = 0; i < len; i++) o[n0 + i] = f32_to_bf16(u[i] * w_scale[n0 + i]);
            }
        }
    }
    return 0;
}
