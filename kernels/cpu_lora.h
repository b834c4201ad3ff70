/* One linear layer's LoRA adapters as the segmented product reads them (cpu_lora.c), shared with
   the fused decode step (cpu_decode_layer.c); mirrored by cpu_lora.LoraWeightsDesc. */
#ifndef PDSERVE_CPU_LORA_H
#define PDSERVE_CPU_LORA_H

#include <stdint.h>

#define LORA_MAX_PARTS 4   /* q, k, v; gate, up */
#define LORA_MAX_H 1024    /* parts * rank */

typedef struct {
    const uint16_t* a;   /* [slots, parts * rank, in] bf16: each slot's A of every part, stacked */
    const uint16_t* bt;  /* [slots, rank, out] bf16: B transposed, the slot's scaling folded in;
                            column n of part p takes h[p * rank .. p * rank + rank) */
    int64_t slots, parts, rank, in, out;
    int64_t part_end[LORA_MAX_PARTS];  /* each part's first column past its own */
} lora_weights;

/* y[t] += the delta of row t's adapter, for every row t with row_slot[t] >= 0 (cpu_lora.c) */
int lora_add_bf16(const lora_weights* w, const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t y_stride,
                  const int32_t* row_slot, int M);

#endif
