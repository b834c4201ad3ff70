/* Fused bf16 RMSNorm and rotary embedding, built by cpu_native.py.

   In plain torch each is 5-7 elementwise ops, each a pass over the activations
   with its own temporary (about 8% of a 512-token prefill on the default model).
   One pass each here, rounding where transformers' bf16 ops round, so outputs
   match theirs bit for bit (up to the order of the float32 sum of squares):

   - RMSNorm: ``bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))``, statistics in float32;
   - rope (rotate-half): ``bf16(bf16(x * cos) + bf16(rot(x) * sin))``, ``rot(x) = [-x2, x1]``,
     cos/sin rows looked up by position. */
#include <stdint.h>

#include "cpu_common.h"

/* x: [T, N] rows at x_stride; w: [N]; out: [T, N] rows at out_stride */
int rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w, uint16_t* out, int64_t out_stride,
                  int T, int N, float eps) {
    #pragma omp parallel for schedule(static) if (T >= 64)
    for (int t = 0; t < T; t++) {
        const uint16_t* xr = x + (int64_t)t * x_stride;
        uint16_t* o = out + (int64_t)t * out_stride;
        float ss = 0.f;
        #pragma omp simd reduction(+:ss)
        for (int i = 0; i < N; i++) { const float v = bf16_to_f32(xr[i]); ss += v * v; }
        const float r = 1.f / sqrtf(ss / (float)N + eps);
        #pragma omp simd
        for (int i = 0; i < N; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[i]) * r)));
    }
    return 0;
}

/* x: [T, NH, D] (heads and dims contiguous) at x_stride per token; cos_t, sin_t: [ctx, D];
   pos: [T] int64; out: [T, NH, D] contiguous */
int rope_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* cos_t, const uint16_t* sin_t,
              const int64_t* pos, uint16_t* out, int T, int NH, int D) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) if (T >= 64)
    for (int t = 0; t < T; t++) {
        const uint16_t* c = cos_t + pos[t] * D;
        const uint16_t* s = sin_t + pos[t] * D;
        for (int h = 0; h < NH; h++) {
            const uint16_t* xr = x + (int64_t)t * x_stride + (int64_t)h * D;
            uint16_t* o = out + ((int64_t)t * NH + h) * D;
            #pragma omp simd
            for (int d = 0; d < half; d++) {
                const float a = bf16_to_f32(xr[d]), b = bf16_to_f32(xr[d + half]);
                const float xc = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(c[d])));
                const float rs = bf16_to_f32(f32_to_bf16(-b * bf16_to_f32(s[d])));
                o[d] = f32_to_bf16(xc + rs);
                const float xc2 = bf16_to_f32(f32_to_bf16(b * bf16_to_f32(c[d + half])));
                const float rs2 = bf16_to_f32(f32_to_bf16(a * bf16_to_f32(s[d + half])));
                o[d + half] = f32_to_bf16(xc2 + rs2);
            }
        }
    }
    return 0;
}
