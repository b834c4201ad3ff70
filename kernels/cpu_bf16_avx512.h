/* bf16 <-> float32 on 16-lane AVX-512 vectors, shared by the native kernels that need them
   (cpu_gemm.c, cpu_gemv.c, cpu_amx_int8.c): the vector forms of cpu_common.h's bf16_to_f32,
   f32_to_bf16 and silu. Include after immintrin.h and cpu_common.h, inside the translation
   unit's AVX-512 guard. */
#ifndef PDSERVE_CPU_BF16_AVX512_H
#define PDSERVE_CPU_BF16_AVX512_H

/* float32 -> bf16, round to nearest even (NaN stays NaN), as f32_to_bf16 */
static inline __m256i round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

/* 16 bf16 -> float32 (exact: a shift) */
static inline __m512 widen_bf16(__m256i b) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* the first ``cnt`` of 16 lanes (all of them from 16 on) */
static inline __mmask16 lanes16(int cnt) {
    return cnt >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cnt) - 1u);
}

/* the first ``cnt`` of 16 output values at out + at: v rounded once to bf16, stored as bf16 or
   (out_f32) widened to float32 */
static inline void store16(void* out, int64_t at, __m512 v, int cnt, int out_f32) {
    const __m256i b = round_bf16(v);
    const __mmask16 mask = lanes16(cnt);
    if (out_f32)
        _mm512_mask_storeu_ps((float*)out + at, mask, widen_bf16(b));
    else
        _mm256_mask_storeu_epi16((uint16_t*)out + at, mask, b);
}

/* silu of 16 lanes (cpu_common.h's, which the compiler vectorizes) */
static inline __m512 silu16(__m512 v) {
    float g[16] __attribute__((aligned(64)));
    _mm512_store_ps(g, v);
    #pragma omp simd
    for (int j = 0; j < 16; j++) g[j] = silu_nonpos_exp(g[j]);
    return _mm512_load_ps(g);
}

#endif
