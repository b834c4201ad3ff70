/* bf16 <-> float32, a vectorizable exp and silu, shared by the native CPU kernels (built by cpu_native.py). */
#ifndef PDSERVE_CPU_COMMON_H
#define PDSERVE_CPU_COMMON_H

#include <stdint.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } c; c.u = (uint32_t)x << 16; return c.f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    union { uint32_t u; float f; } c; c.f = f;
    uint32_t u = c.u;
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
/* exp for x <= 0 in plain float ops, so loops over it vectorize (libm's expf does not):
   x = n ln2 + r, |r| <= ln2 / 2; degree-6 Taylor for exp(r), relative error ~1e-7 */
static inline float exp_nonpos(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = floorf(x * 1.44269504089f + 0.5f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    const float p = 1.f + r * (1.f + r * (0.5f + r * (0.16666667f + r * (0.041666668f
                    + r * (0.008333334f + r * 0.0013888889f)))));
    union { uint32_t u; float f; } c; c.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * c.f;
}
/* silu(g) = g * sigmoid(g) through exp of a non-positive argument (vectorizes): w8a8's SwiGLU,
   one formula for both of its product paths (cpu_int8_act.c, cpu_amx_int8.c), which are tested
   to agree bit for bit */
static inline float silu_nonpos_exp(float g) {
    const float e = exp_nonpos(-fabsf(g));
    return g >= 0.f ? g / (1.f + e) : g * e / (1.f + e);
}

#endif
