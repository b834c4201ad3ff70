/* What the AMX kernels share (cpu_amx_int8.c, cpu_gemv.c's w8 products): Linux's permission for
   the tiles and the one tile configuration they all use. Include where __AMX_TILE__ is defined. */
#ifndef PDSERVE_CPU_AMX_H
#define PDSERVE_CPU_AMX_H

#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023  /* Linux: ask for a state component's permission */
#define XFEATURE_XTILEDATA 18       /* the AMX tiles' data */
#define TILE_BYTES 1024             /* one tile: 16 rows of 64 bytes */

/* 1 where Linux lets this process use the tiles (asked here; the permission holds for every
   thread of the process, and asking again is harmless) */
static inline int amx_permitted(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* this thread's 8 tiles as 16 rows of 64 bytes each: int8 (16 x 64, or 16 x 16 int32 sums),
   bf16 (16 x 32, or 16 x 16 float32 sums) */
static inline void amx_tiles_on(void) {
    amx_tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    /* ldtilecfg's intrinsic (gcc 12) does not tell the compiler that it reads c: without this the
       stores above can be dropped as dead, and ldtilecfg faults on what is left on the stack */
    __asm__ __volatile__("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}

#endif
