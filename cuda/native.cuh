/* Device helpers of the native FlashAttention-2-style kernels (native_forward.cu, native_backward.cu), and the
 * host-side tile table and validation both entry points share.
 *
 * Fragments follow PTX's mma.m16n8k16 layout (lane = 4 * group + t, group 0..7, t 0..3):
 *   A (16 x 16, row-major)  reg 0: row group,     cols 2t, 2t+1     reg 1: row group + 8, cols 2t, 2t+1
 *                           reg 2: row group,     cols 2t+8, 2t+9   reg 3: row group + 8, cols 2t+8, 2t+9
 *   B (16 x 8, k x n)       reg 0: rows 2t, 2t+1, col group         reg 1: rows 2t+8, 2t+9, col group
 *   C (16 x 8, fp32)        c0, c1: row group, cols 2t, 2t+1        c2, c3: row group + 8, cols 2t, 2t+1
 * (two 16-bit elements per register, the lower column / row in the low half). So the C fragments of two
 * adjacent 8-column blocks, rounded and packed in pairs, are exactly the A fragment of a 16-column block: P and
 * dS go from one mma's accumulators to the next mma's A operand without leaving registers.
 *
 * Shared-memory tiles are rows of 16-byte chunks (8 elements); chunk c of row r lives at chunk c ^ swz(r), so the 8
 * rows one ldmatrix phase reads at the same logical chunk fall in 8 different bank groups (no conflicts, no
 * padding), and the cp.async writes of a warp (whole rows) stay conflict-free too. */
#ifndef FADEV_NATIVE_CUH
#define FADEV_NATIVE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "../csrc/stage.h"

/* ---------------------------------------------------------------- element types */

/* Round two fp32 values to T (nearest even) and pack them as one mma register, `lo` in the low half. */
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    union { __half2 h; uint32_t u; } x;
    x.h = __floats2half2_rn(lo, hi);
    return x.u;
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    union { __nv_bfloat162 h; uint32_t u; } x;
    x.h = __floats2bfloat162_rn(lo, hi);
    return x.u;
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* ---------------------------------------------------------------- PTX wrappers */

__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* c += A B: m16n8k16, fp16 or bf16 operands, fp32 accumulators. */
template <typename T> __device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                               uint32_t b1);
template <> __device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                              uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                                     uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Four 8x8 matrices of 16-bit elements; lanes 8i .. 8i+7 give the addresses of matrix i's 8 rows (16 bytes each).
 * Register i of lane l: row l/4, elements 2(l%4), 2(l%4)+1 of matrix i; with .trans, rows 2(l%4), 2(l%4)+1 of
 * column l/4 (the matrix transposed). */
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p))
                 : "memory");
}

/* Asynchronous global -> shared copies; `valid` false writes zeros and reads nothing (src must still be a
 * valid address, callers pass the tensor's base). */
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_4(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

/* 2^x on the special-function unit (relative error ~2^-22; 2^-inf = 0). */
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* ---------------------------------------------------------------- warp reductions */

/* Over the 4 lanes of a quad (the lanes holding one fragment row) and over the warp. */
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float warp_sum(float x) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

/* ---------------------------------------------------------------- shared-memory layout and tile loads */

/* Element offset of (row, chunk) in a swizzled tile of CHUNKS 16-byte chunks per row. */
template <int CHUNKS> __device__ __forceinline__ int swz(int row, int chunk) {
    static_assert(CHUNKS == 4 || CHUNKS % 8 == 0, "rows of 4 or a multiple of 8 chunks");
    const int x = CHUNKS >= 8 ? (row & 7) : ((row >> 1) & 3);
    return row * (CHUNKS * 8) + ((chunk ^ x) << 3);
}

/* cp.async rows [row0, row0 + ROWS) of a (nrows x D) row-major slab into a swizzled tile; rows >= nrows are
 * zero-filled. NT threads, thread `tid`. */
template <typename T, int ROWS, int D, int NT>
__device__ __forceinline__ void load_rows(T *tile, const T *slab, int row0, int nrows, int tid) {
    constexpr int C = D / 8, N = ROWS * C;
#pragma unroll
    for (int i = 0; i < (N + NT - 1) / NT; ++i) {
        const int c = tid + i * NT;
        if (N % NT == 0 || c < N) {
            const int r = c / C, ch = c % C;
            const bool ok = row0 + r < nrows;
            cp_async_16(tile + swz<C>(r, ch), slab + (ok ? (int64_t)(row0 + r) * D + ch * 8 : 0), ok);
        }
    }
}

/* ---------------------------------------------------------------- host: tiles and validation */

#define NATIVE_MAX_SEQ (1 << 30) /* keeps every row index sum (i + Nk - Nq, tile ends) inside int */
#define NATIVE_LOG2E 1.4426950408889634
#define NATIVE_LN2 0.69314718055994531f

/* (block_q, block_kv) pairs compiled for each head dim. */
static const int32_t native_tiles_64[][2] = {{64, 64}, {128, 64}, {128, 128}};
static const int32_t native_tiles_128[][2] = {{64, 64}, {128, 64}};

static inline int native_tile_count(int dim) { return dim == 64 ? 3 : dim == 128 ? 2 : 0; }
static inline const int32_t (*native_tile_list(int dim))[2] {
    return dim == 64 ? native_tiles_64 : native_tiles_128;
}

static inline fadev_status native_bad(fadev_status st, const char *message) {
    return fadev_cuda_fail_msg(st, message);
}

/* Shapes, tiles, dtype and sizes (both entry points; the grid bound is checked for the smallest tiles). */
static inline fadev_status native_validate(const fadev_native_params *p) {
    if (!p) return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: params is NULL");
    const char *why = "";
    const fadev_status shape = att_check_params(&p->attn, 256, 0, &why); /* the CPU kernels' checks (stage.h) */
    if (shape != FADEV_OK) {
        char message[128];
        snprintf(message, sizeof message, "native attention: %s", why);
        return native_bad(shape, message);
    }
    if (p->attn.dim != 64 && p->attn.dim != 128)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: dim must be 64 or 128");
    if (p->dtype != FADEV_NATIVE_FP16 && p->dtype != FADEV_NATIVE_BF16)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: dtype must be fp16 (0) or bf16 (1)");
    int found = 0;
    const int dim = (int)p->attn.dim;
    for (int i = 0; i < native_tile_count(dim); i++)
        found |= native_tile_list(dim)[i][0] == p->attn.block_q && native_tile_list(dim)[i][1] == p->attn.block_kv;
    if (!found)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT,
                          "native attention: (block_q, block_kv) is not a compiled tile (see fadev_cuda_native_tiles)");
    if (p->attn.seq_q > NATIVE_MAX_SEQ || p->attn.seq_kv > NATIVE_MAX_SEQ)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: seq_q and seq_kv must be <= 2^30");
    /* grids are 1-D: batch * heads * query tiles (forward), batch * heads_kv * key tiles (backward) */
    const int64_t grid_max = INT32_MAX, n_qt = (p->attn.seq_q + 31) / 32, n_kt = (p->attn.seq_kv + 63) / 64;
    if (p->attn.batch > grid_max || p->attn.heads > grid_max / p->attn.batch || p->attn.batch * p->attn.heads > grid_max / n_qt ||
        p->attn.batch * p->attn.heads_kv > grid_max / n_kt)
        return native_bad(FADEV_ERR_OVERFLOW, "native attention: batch * heads * tiles exceeds the grid limit");
    /* element counts (and their float32 workspace) must fit size_t; seq * dim < 2^38 already */
    const uint64_t limit = (uint64_t)SIZE_MAX / 8;
    const uint64_t bh = (uint64_t)p->attn.batch * (uint64_t)p->attn.heads, seq = (uint64_t)(p->attn.seq_q > p->attn.seq_kv ? p->attn.seq_q : p->attn.seq_kv);
    if (bh > limit / (seq * (uint64_t)p->attn.dim + 1))
        return native_bad(FADEV_ERR_OVERFLOW, "native attention: tensor sizes overflow size_t");
    return FADEV_OK;
}

/* Device pointers the kernels read or write in 16-byte pieces must be 16-byte aligned. */
static inline int native_aligned(const void *p, uintptr_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

#endif /* FADEV_NATIVE_CUH */
