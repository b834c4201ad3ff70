/* The KV store of one layer: T new tokens' K and V rows copied into their slots of the layer's
   head-major pool tensors ([kv_heads, pages, page_size, head_dim], engine/mem_cache/page_pool.py).
   Built by cpu_native.py; the per-op path (``NativeKernels.store_kv``) and the fused decode step
   (cpu_decode_layer.c) both store through it.

   torch's index_copy_ over the pool's [heads, slots, dim] planes took 45-51 us per call for a
   64-sequence decode step (3 heads x 64 dims), 2.7-3 ms of the step's 58-70 ms over 30 layers'
   K and V; these are 384 copies of 128 bytes. Everything is in bytes, so any dtype goes. */
#include <stdint.h>
#include <string.h>

/* k, v: token t's head j at byte t * tok_stride + j * head_stride (each its own strides);
   caches: slot s of head j at byte s * slot_stride + j * cache_head_stride; loc: [T] slots;
   row_bytes: one head's row (head_dim elements). */
int kv_store(const uint8_t* k, int64_t k_tok_stride, int64_t k_head_stride, const uint8_t* v, int64_t v_tok_stride,
             int64_t v_head_stride, uint8_t* k_cache, uint8_t* v_cache, int64_t slot_stride, int64_t cache_head_stride,
             const int64_t* loc, int T, int heads, int64_t row_bytes) {
    for (int t = 0; t < T; t++) {
        const int64_t slot = loc[t] * slot_stride;
        for (int j = 0; j < heads; j++) {
            memcpy(k_cache + slot + j * cache_head_stride, k + t * k_tok_stride + j * k_head_stride, (size_t)row_bytes);
            memcpy(v_cache + slot + j * cache_head_stride, v + t * v_tok_stride + j * v_head_stride, (size_t)row_bytes);
        }
    }
    return 0;
}
