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

/* x: [M, K] bf16 rows at x_stride -> q: [M, K] int8 contiguous, scale: [M] with
   x[m, k] ~= q[m, k] * scale[m]; scale = max|x[m]| / 127 (0 for an all-zero row, whose q is 0) */
int quant_rows_s8(const uint16_t* x, int64_t x_stride, int8_t* q, float* scale, int M, int K) {
    #pragma omp parallel for schedule(static) if (M >= 64)
    for (int m = 0; m < M; m++) {
        const uint16_t* xr = x + (int64_t)m * x_stride;
        int8_t* qr = q + (int64_t)m * K;
        float amax = 0.f;
        #pragma omp simd reduction(max:amax)
        for (int k = 0; k < K; k++) { const float v = fabsf(bf16_to_f32(xr[k])); amax = v > amax ? v : amax; }
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        scale[m] = amax / 127.f;
        #pragma omp simd
        for (int k = 0; k < K; k++) {
            float v = rintf(bf16_to_f32(xr[k]) * inv);  /* nearest, ties to even, as torch.round */
            v = v > 127.f ? 127.f : v < -127.f ? -127.f : v;
            qr[k] = (int8_t)v;
        }
    }
    return 0;
}

static inline float silu_vec(float g) {  /* g * sigmoid(g) through exp of a non-positive argument */
    const float e = exp_nonpos(-fabsf(g));
    return g >= 0.f ? g / (1.f + e) : g * e / (1.f + e);
}

/* acc: [M, N] int32 contiguous; a_scale: [M]; w_scale: [N]; out rows at out_stride. mode:
     0: out[m, n] = bf16(acc * a_scale[m] * w_scale[n]), [M, N];
     1: the same plus res[m, n] (bf16, rows at res_stride) before the one rounding, as oneDNN's add;
     2: the columns are gate | up (N = 2 I) and out is [M, I]: bf16(up * bf16(silu(gate))), the
        rounding of the bf16 path's fused swish and mul post-ops. */
int int8_epilogue_bf16(const int32_t* acc, const float* a_scale, const float* w_scale, uint16_t* out,
                       int64_t out_stride, const uint16_t* res, int64_t res_stride, int M, int N, int mode) {
    const int I = N / 2;
    #pragma omp parallel for schedule(static) if (M >= 64)
    for (int m = 0; m < M; m++) {
        const int32_t* a = acc + (int64_t)m * N;
        uint16_t* o = out + (int64_t)m * out_stride;
        const float s = a_scale[m];
        if (mode == 2) {
            #pragma omp simd
            for (int i = 0; i < I; i++) {
                const float g = bf16_to_f32(f32_to_bf16(silu_vec((float)a[i] * s * w_scale[i])));
                o[i] = f32_to_bf16((float)a[I + i] * s * w_scale[I + i] * g);
            }
        } else if (mode == 1) {
            const uint16_t* r = res + (int64_t)m * res_stride;
            #pragma omp simd
            for (int n = 0; n < N; n++) o[n] = f32_to_bf16((float)a[n] * s * w_scale[n] + bf16_to_f32(r[n]));
        } else {
            #pragma omp simd
            for (int n = 0; n < N; n++) o[n] = f32_to_bf16((float)a[n] * s * w_scale[n]);
        }
    }
    return 0;
}
