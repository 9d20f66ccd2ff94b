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

#include <type_traits>

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


#define NATIVE_LOG2E 1.4426950408889634
#define NATIVE_LN2 0.69314718055994531f

/* 2^x on the special-function unit (relative error ~2^-22; 2^-inf = 0). */
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

/* f(std::true_type{}) or f(std::false_type{}): a tile's element loop compiled twice, with its mask checks and
 * without (the tiles inside the sequence and the diagonal need none). Written out because ptxas does not always
 * unswitch the loop itself: when the strided addressing grew the wgmma backward's loop, it stopped doing so and
 * predicated every element of every tile instead (SASS: half the MUFU.EX2, 3x the PLOP3), +33% time on an H200. */
template <typename F> __device__ __forceinline__ void with_mask(bool masked, F &&f) {
    if (masked)
        f(std::true_type{});
    else
        f(std::false_type{});
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
    static_assert(CHUNKS == 2 || CHUNKS == 4 || CHUNKS % 8 == 0, "rows of 2, 4 or a multiple of 8 chunks");
    const int x = CHUNKS >= 8 ? (row & 7) : CHUNKS == 4 ? ((row >> 1) & 3) : ((row >> 2) & 1);
    return row * (CHUNKS * 8) + ((chunk ^ x) << 3);
}

/* Element offset of (row, chunk) in a tile of R rows stored as 64-column panels with the 128-byte swizzle (the wgmma
 * kernel's layout, wgmma.cuh). */
template <int R> __device__ __forceinline__ int wswz(int row, int chunk) {
    return (chunk >> 3) * (R * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

/* ---------------------------------------------------------------- global layout */

/* Element strides of a (B, H, N, D) tensor's batch, head and row; a row's D elements are contiguous. Contiguous:
 * (H N D, N D, D). fadev_native_params.strides gives them per tensor (a model's transposed views are read in place). */
struct native_strides {
    int64_t b, h, r;
};
/* One head of such a tensor: its row 0 and the elements from one row to the next. */
template <typename T> struct head_rows {
    T *p;
    int64_t rs;
    __device__ __forceinline__ T *row(int64_t i) const { return p + i * rs; }
};
/* Head h of batch b of the tensor at `base` with strides s. */
template <typename T>
__device__ __forceinline__ head_rows<T> head_at(const void *base, const native_strides &s, int64_t b, int64_t h) {
    return {static_cast<T *>(const_cast<void *>(base)) + b * s.b + h * s.h, s.r};
}
/* Head bh = b * heads + h (bh < 2^31: grids are 1-D; 32-bit division, not int64's software routine). */
template <typename T>
__device__ __forceinline__ head_rows<T> head_of(const void *base, const native_strides &s, int bh, int heads) {
    return head_at<T>(base, s, bh / heads, bh % heads);
}
/* a / b, and a % b in r, for 0 <= a, 0 < b: 32-bit division where a < 2^32 (the row counts of every real call). */
__device__ __forceinline__ int64_t div_mod(int64_t a, int b, int64_t &r) {
    if (!((uint64_t)a >> 32)) {
        const uint32_t q = (uint32_t)a / (uint32_t)b;
        r = (int64_t)((uint32_t)a - q * (uint32_t)b);
        return q;
    }
    const int64_t q = a / b;
    r = a - q * b;
    return q;
}

/* cp.async rows [row0, row0 + ROWS) of one head's rows (nrows of them) into a swizzled tile (PANELS: wswz's layout,
 * else swz's); rows >= nrows are zero-filled. NT threads, thread `tid`. */
template <typename T, int ROWS, int D, int NT, bool PANELS = false>
__device__ __forceinline__ void load_rows(T *tile, const head_rows<const T> &slab, int row0, int nrows, int tid) {
    constexpr int C = D / 8, N = ROWS * C, STEP = NT / C;
    static_assert(NT % C == 0, "a thread's chunks share their column: one source pointer, advanced STEP rows a copy");
    /* thread tid copies column chunk tid % C of rows tid / C, + STEP, ..: one 64-bit pointer advanced by a fixed
     * step, not a 64-bit offset per copy (which ptxas would keep live across the K/V loop: registers) */
    const int r0 = tid / C, ch = tid % C;
    const T *src = slab.row(row0 + r0) + ch * 8;
#pragma unroll
    for (int i = 0; i < (N + NT - 1) / NT; ++i) {
        const int r = r0 + i * STEP;
        if (N % NT == 0 || r < ROWS) {
            const bool ok = row0 + r < nrows;
            cp_async_16(tile + (PANELS ? wswz<ROWS>(r, ch) : swz<C>(r, ch)), ok ? src : slab.p, ok);
        }
        src += STEP * slab.rs;
    }
}

/* The K/V loop's prefetch: tile j + 1 (if any) of K and V into the other of two stages of BKV rows (PANELS: wgmma's
 * layout), then commit the copy group (an empty one on the last tile, so every iteration's wait sees the same group
 * count). */
template <typename T, int BKV, int D, int NT, bool PANELS = false>
__device__ __forceinline__ void prefetch_kv(T *sK, T *sV, const head_rows<const T> &K, const head_rows<const T> &V, int j,
                                            int n_kt, int seq_kv, int tid) {
    if (j + 1 < n_kt) {
        const int st = (j + 1) & 1;
        load_rows<T, BKV, D, NT, PANELS>(sK + st * BKV * D, K, (j + 1) * BKV, seq_kv, tid);
        load_rows<T, BKV, D, NT, PANELS>(sV + st * BKV * D, V, (j + 1) * BKV, seq_kv, tid);
    }
    cp_async_commit();
}

/* ---------------------------------------------------------------- the backward's kernels (native_backward*.cu) */

struct native_bwd_args {
    const void *q, *k, *v, *dout;
    const float *lse, *dvec;
    float *dq_acc; /* the atomic dQ sums; NULL in the deterministic mode (dQ by native_dq_pass) */
    void *dq, *dk, *dv;
    int heads, group, seq_q, seq_kv, n_kt, n_qt, causal; /* group = heads / heads_kv; key / query tiles per head */
    float scale_log2, scale;                             /* scale * log2(e), scale */
    native_strides sq, sk, sv, so, sdo, sdq, sdk, sdv;   /* of q, k, v, out, dout, dq, dk, dv (dq_acc: contiguous) */
    cudaStream_t stream;                                 /* fadev_native_params.stream (NULL: the legacy default) */
};

/* The CTA's key tile (both backward dK/dV kernels): key tile kt of K/V head b * Hkv + hk, its rows, and the query
 * tiles of block_q rows that see one of its keys, over the query heads of its group: iteration it is query head
 * hk * group + it / per_head, tile qt_start + it % per_head (causal: query i sees key j iff j <= i + off). issue()
 * starts the cp.async copies of iteration it's Q, dO, lse and Dvec into stage st (PANELS: the wgmma layout). */
template <typename T, int D, int BKV, int BQ> struct bwd_tile {
    head_rows<const T> K, V;
    int64_t bhk, b, hk;
    int k0, off, qt_start, n_it, per_head;
    __device__ __forceinline__ explicit bwd_tile(const native_bwd_args &a) {
        const int kt = (int)(blockIdx.x % a.n_kt);
        bhk = blockIdx.x / a.n_kt; /* b * Hkv + hk */
        const int heads_kv = a.heads / a.group;
        b = bhk / heads_kv, hk = bhk % heads_kv;
        K = head_at<const T>(a.k, a.sk, b, hk);
        V = head_at<const T>(a.v, a.sv, b, hk);
        k0 = kt * BKV, off = a.seq_kv - a.seq_q;
        const int n_qt = (a.seq_q + BQ - 1) / BQ;
        qt_start = 0, n_it = a.group * n_qt;
        if (a.causal) {
            const int i_min = k0 - off;
            qt_start = i_min >= a.seq_q ? n_qt : max(i_min, 0) / BQ;
            n_it = a.group * (n_qt - qt_start);
        }
        per_head = n_qt - qt_start;
    }
    __device__ __forceinline__ int64_t head_of(const native_bwd_args &a, int it) const {
        return b * a.heads + hk * a.group + it / per_head;
    }
    __device__ __forceinline__ int first_row(int it) const { return (qt_start + it % per_head) * BQ; }
    template <int NT, bool PANELS>
    __device__ __forceinline__ void issue(const native_bwd_args &a, int it, T *sQ, T *sdO, float *sL, float *sDv,
                                          int tid) const {
        const int64_t bh = head_of(a, it), h = hk * a.group + it / per_head;
        const int q0 = first_row(it);
        load_rows<T, BQ, D, NT, PANELS>(sQ, head_at<const T>(a.q, a.sq, b, h), q0, a.seq_q, tid);
        load_rows<T, BQ, D, NT, PANELS>(sdO, head_at<const T>(a.dout, a.sdo, b, h), q0, a.seq_q, tid);
        for (int r = tid; r < BQ; r += NT) {
            const bool ok = q0 + r < a.seq_q;
            const int64_t at = bh * a.seq_q + (ok ? q0 + r : 0);
            cp_async_4(sL + r, a.lse + at, ok);
            cp_async_4(sDv + r, a.dvec + at, ok);
        }
    }
};

/* The dQ pass's query tile (both instructions' passes): tile n_qt - 1 - blockIdx.x % n_qt (the longest causal rows
 * first) of query head bh = blockIdx.x / n_qt, its K/V head's tiles of BKV keys that some row sees, and for this
 * lane's rows q0 + 16 warp + g and + 8 (BQ / 16 warps): the last key each may see (lim), lse in log2 units, Dvec. */
template <typename T, int D, int BQ, int BKV> struct dq_tile {
    head_rows<const T> Q, dO, K, V;
    head_rows<T> dQ;
    int64_t bh;
    int q0, off, n_kt, row0, lim[2];
    float lse2[2], dvec[2];
    __device__ __forceinline__ dq_tile(const native_bwd_args &a, int warp, int g)
        : dq_tile(a, warp, g, blockIdx.x / a.n_qt, a.n_qt - 1 - (int)(blockIdx.x % a.n_qt)) {}
    /* query tile qt (of BQ rows) of head bh = b * H + h */
    __device__ __forceinline__ dq_tile(const native_bwd_args &a, int warp, int g, int64_t bh_, int qt) : bh(bh_) {
        const int b = (int)bh / a.heads, h = (int)bh % a.heads;
        Q = head_at<const T>(a.q, a.sq, b, h);
        dO = head_at<const T>(a.dout, a.sdo, b, h);
        dQ = head_at<T>(a.dq, a.sdq, b, h);
        K = head_at<const T>(a.k, a.sk, b, h / a.group);
        V = head_at<const T>(a.v, a.sv, b, h / a.group);
        q0 = qt * BQ, off = a.seq_kv - a.seq_q;
        int kv_end = a.seq_kv; /* keys [0, kv_end) are visible to some row of this tile */
        if (a.causal) kv_end = min(kv_end, min(q0 + BQ, a.seq_q) + off);
        n_kt = kv_end > 0 ? (kv_end + BKV - 1) / BKV : 0;
        row0 = q0 + warp * 16 + g;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + 8 * r;
            lim[r] = a.seq_kv - 1;
            if (a.causal) lim[r] = min(lim[r], row + off);
            lse2[r] = row < a.seq_q ? a.lse[bh * a.seq_q + row] * (float)NATIVE_LOG2E : 0.f;
            dvec[r] = row < a.seq_q ? a.dvec[bh * a.seq_q + row] : 0.f;
        }
    }
    /* The pass's shared memory from `base`: Q and dO (BQ rows each), then two stages each of K and V (BKV rows). */
    struct smem_tiles {
        T *q, *dO, *k, *v;
    };
    static __device__ __forceinline__ smem_tiles carve(T *base) {
        return {base, base + BQ * D, base + 2 * BQ * D, base + 2 * BQ * D + 2 * BKV * D};
    }
    /* Q, dO and K/V tile 0 into shared memory (PANELS: wgmma's layout), one copy group; NT threads */
    template <int NT, bool PANELS>
    __device__ __forceinline__ void load_first(const native_bwd_args &a, T *sQ, T *sdO, T *sK, T *sV, int tid) const {
        load_rows<T, BQ, D, NT, PANELS>(sQ, Q, q0, a.seq_q, tid);
        load_rows<T, BQ, D, NT, PANELS>(sdO, dO, q0, a.seq_q, tid);
        if (n_kt > 0) {
            load_rows<T, BKV, D, NT, PANELS>(sK, K, 0, a.seq_kv, tid);
            load_rows<T, BKV, D, NT, PANELS>(sV, V, 0, a.seq_kv, tid);
        }
        cp_async_commit();
    }
    /* tile j (keys kv0 = j BKV ..) needs masks: ragged end, or keys past the tile's first row's diagonal */
    __device__ __forceinline__ bool masked(const native_bwd_args &a, int kv0) const {
        return kv0 + BKV > a.seq_kv || (a.causal && kv0 + BKV - 1 > q0 + off);
    }
    /* dS = P (dP - Dvec) from the score s and dP of this lane's element in row half r at key `key` (MASK: the
     * tile needs the mask checks, with_mask) */
    template <bool MASK>
    __device__ __forceinline__ float ds(const native_bwd_args &a, float s, float dp, int r, int key) const {
        float p = fast_exp2(s * a.scale_log2 - lse2[r]);
        if (MASK && key > lim[r]) p = 0.f;
        return p * (dp - dvec[r]);
    }
    /* dS = P (dP - Dvec) in place of the scores s of K/V tile j, this lane's BKV / 2 of them as both passes hold them
     * (the C fragments of BKV / 8 key blocks: element 4 nb + e is row half e >> 1, key j BKV + 8 nb + 2 t4 + (e & 1)) */
    __device__ __forceinline__ void ds_tile(const native_bwd_args &a, float *s, const float *dp, int j, int t4) const {
        const int kv0 = j * BKV;
        with_mask(masked(a, kv0), [&](auto mask) {
#pragma unroll
            for (int nb = 0; nb < BKV / 8; ++nb)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    s[4 * nb + e] = ds<mask.value>(a, s[4 * nb + e], dp[4 * nb + e], e >> 1, kv0 + nb * 8 + 2 * t4 + (e & 1));
        });
    }
    /* dq = round(scale dQ) of this lane's accumulators (the C fragments of D / 8 column blocks) */
    __device__ __forceinline__ void store_all(const native_bwd_args &a, const float *dq, int t4) const {
#pragma unroll
        for (int db = 0; db < D / 8; ++db)
#pragma unroll
            for (int r = 0; r < 2; ++r) store(a, r, db * 8 + 2 * t4, dq[4 * db + 2 * r], dq[4 * db + 2 * r + 1]);
    }
    /* dq = round(scale dQ): this lane's two columns col, col + 1 of row half r */
    __device__ __forceinline__ void store(const native_bwd_args &a, int r, int col, float x0, float x1) const {
        const int row = row0 + 8 * r;
        if (row < a.seq_q)
            *reinterpret_cast<uint32_t *>(dQ.row(row) + col) =
                pack2<T>(x0 * a.scale, x1 * a.scale);
    }
};

/* The backward's steps around its dK/dV kernel (native_backward.cu): dQ_acc zeroed and Dvec before, dQ after (the
 * atomic sums rounded, or native_dq_pass); instantiated for fp16 / bf16 at D 64 and 128. */
template <typename T, int D>
fadev_status native_backward_before(const fadev_native_params *p, const native_bwd_args &a, const void *out);
template <typename T, int D> fadev_status native_backward_after(const fadev_native_params *p, const native_bwd_args &a);
/* The dK/dV kernel on Hopper's warpgroup MMA (native_backward_wgmma.cu; mma 1); a.n_kt set. */
fadev_status native_backward_wgmma(const fadev_native_params *p, const native_bwd_args &a, const void *out);

/* The dK/dV kernel with a producer warpgroup and tensor-memory-accelerator loads (native_backward_tma_wgmma.cu): the
 * 64 x 128 tile at D 64 and 128 where the copy engine can describe the layout; *ran says whether it ran. The same
 * bits as native_backward_wgmma's kernel (the atomic mode's dq: the same sums, added in another order). */
fadev_status native_backward_tma(const fadev_native_params *p, const native_bwd_args &a, bool *ran);

/* The instances a dQ pass launches (both instructions' passes): launch(T{}, std::integral_constant<int, D>{}) for the
 * call's element type T (fp16, bf16) and head dim D (64, 128). */
template <typename F> static inline fadev_status native_dq_dispatch(const fadev_native_params *p, F &&launch) {
    const bool half = p->dtype == FADEV_NATIVE_FP16;
    using D64 = std::integral_constant<int, 64>;
    using D128 = std::integral_constant<int, 128>;
    if (p->attn.dim == 64) return half ? launch(__half(), D64()) : launch(__nv_bfloat16(), D64());
    return half ? launch(__half(), D128()) : launch(__nv_bfloat16(), D128());
}

/* The deterministic backward's dQ pass (native_backward_dq.cu): dQ = scale * sum over K/V tiles of round(dS) K, in
 * key order, with dS recomputed from Q, K, V, dO, lse and Dvec (a.dvec); writes a.dq. */
fadev_status native_dq_pass(const fadev_native_params *p, native_bwd_args a);
/* The same pass on Hopper's warpgroup MMA (native_backward_dq_wgmma.cu; the wgmma backward's): the same bits. */
fadev_status native_dq_pass_wgmma(const fadev_native_params *p, native_bwd_args a);
/* The same pass with a producer warpgroup and tensor-memory-accelerator loads (native_backward_dq_tma_wgmma.cu) where
 * the layout can be described to the copy engine: *ran says whether it ran. The same bits. */
fadev_status native_dq_pass_tma(const fadev_native_params *p, const native_bwd_args &a, bool *ran);

/* ---------------------------------------------------------------- host: tiles and validation */

#define NATIVE_MAX_SEQ (1 << 30) /* keeps every row index sum (i + Nk - Nq, tile ends) inside int */
#define NATIVE_DQ_BLOCK_Q 64 /* query rows per CTA of the deterministic backward's dQ pass */

/* The compiled tiles, one X(dim, block_q, block_kv) per template instance: the dispatchers and the tables that
 * fadev_cuda_native_tiles reports are expanded from these lists, so they cannot disagree. The first tile of a head
 * dim is its default. Forward: block_q / 16 warps, each holding 16 query rows (Q, O fragments) and a 16 x block_kv
 * score tile in registers; ptxas spills at D 128 with block_kv 128 or 16 x 64, and at D 64 with 16 x 128, so those
 * are not compiled (D 128, 16 x 32 spills 8 bytes). Backward: block_kv / 16 warps, each holding 16 keys' dK, dV (D
 * floats a lane) and a block_q-column S^T and dP^T (block_q floats), so block_q + D stays <= 160 (no spills but 4
 * bytes at D 64, 32 x 16; D 128, 32 x 16 spills 44 bytes and is not compiled). */
#define NATIVE_FORWARD_TILES(X)                                                                                  \
    X(64, 64, 64) X(64, 128, 64) X(64, 128, 128) X(64, 16, 16) X(64, 16, 32) X(64, 16, 64) X(64, 32, 16)        \
    X(64, 32, 32) X(64, 32, 64) X(64, 32, 128) X(64, 64, 16) X(64, 64, 32) X(64, 64, 128) X(64, 128, 16)        \
    X(64, 128, 32)                                                                                               \
    X(128, 64, 64) X(128, 128, 64) X(128, 16, 16) X(128, 16, 32) X(128, 32, 16) X(128, 32, 32) X(128, 32, 64)   \
    X(128, 64, 16) X(128, 64, 32) X(128, 128, 16) X(128, 128, 32)
/* The forward with 32 query rows per warp (two m16 row blocks side by side: half the shared-memory reads of K and V
 * per product; Q re-read from shared memory where it does not fit in registers beside S and O). ptxas (sm_90): 241
 * and 248 registers for D 64 128 x 64 and 64 x 64; 128 bytes of spills at D 64 128 x 128 and D 128 128 x 64, 12 at
 * D 128 128 x 32 (D 128 64 x 64 spilled 324 and is not compiled). */
#define NATIVE_FORWARD_TILES_32(X) X(64, 128, 64) X(64, 64, 64) X(64, 128, 128) X(128, 128, 32) X(128, 128, 64)
#define NATIVE_BACKWARD_TILES(X)                                                                                 \
    X(64, 64, 64) X(64, 16, 16) X(64, 16, 32) X(64, 16, 64) X(64, 16, 128) X(64, 32, 16) X(64, 32, 32)          \
    X(64, 32, 64) X(64, 32, 128) X(64, 64, 16) X(64, 64, 32) X(64, 64, 128)                                      \
    X(128, 32, 64) X(128, 16, 16) X(128, 16, 32) X(128, 16, 64) X(128, 16, 128) X(128, 32, 32)                  \
    X(128, 32, 128)

/* The backward with 32 keys per warp (two m16 key blocks side by side: half the shared-memory reads of Q and dO per
 * product), D 64 only (dK, dV of 32 keys take 128 registers): ptxas (sm_90) 255, 236, 238 registers without spills
 * for 32 x 128, 16 x 128, 16 x 64; 28 bytes of spills at 32 x 64 (64-row query tiles spill 700+). */
#define NATIVE_BACKWARD_TILES_32(X) X(64, 32, 128) X(64, 16, 128) X(64, 16, 64) X(64, 32, 64)

/* The forward on Hopper's warpgroup MMA (mma 1, native_forward_wgmma.cu; sm_90a): block_q / 64 warpgroups of 4 warps,
 * each holding 64 query rows' O and a 64 x block_kv score tile in registers (D / 2 + block_kv / 2 floats a thread). */
#define NATIVE_FORWARD_TILES_WGMMA(X)                                                                            \
    X(64, 128, 128) X(64, 128, 64) X(64, 64, 128) X(64, 64, 64) X(64, 192, 128) X(64, 192, 64)                  \
    X(128, 128, 128) X(128, 128, 64) X(128, 64, 128) X(128, 64, 64)
/* The backward on warpgroup MMA (native_backward_wgmma.cu): block_kv / 64 warpgroups of 64 keys, each holding its
 * keys' dK and dV (D / 2 floats a thread each) and a 64 x block_q score tile; at D 128 (dK and dV take 128 registers
 * a thread) block_q 32, the mma.sync backward's D 128 tiles, and 64 x 128 (253 registers, no spills; no mma.sync
 * twin: its dK, dV and deterministic dq are the 32 x 128 tile's bits, the same k16 query chunks in the same order). */
#define NATIVE_BACKWARD_TILES_WGMMA(X) X(64, 64, 128) X(64, 64, 64) X(128, 32, 128) X(128, 32, 64) X(128, 64, 128)

#define NATIVE_TILE_ROW(dim, bq, bkv) {dim, bq, bkv},
static const int32_t native_forward_tiles[][3] = {NATIVE_FORWARD_TILES(NATIVE_TILE_ROW)};
static const int32_t native_forward_tiles_32[][3] = {NATIVE_FORWARD_TILES_32(NATIVE_TILE_ROW)};
static const int32_t native_backward_tiles[][3] = {NATIVE_BACKWARD_TILES(NATIVE_TILE_ROW)};
static const int32_t native_backward_tiles_32[][3] = {NATIVE_BACKWARD_TILES_32(NATIVE_TILE_ROW)};
static const int32_t native_forward_tiles_wgmma[][3] = {NATIVE_FORWARD_TILES_WGMMA(NATIVE_TILE_ROW)};
static const int32_t native_backward_tiles_wgmma[][3] = {NATIVE_BACKWARD_TILES_WGMMA(NATIVE_TILE_ROW)};
#undef NATIVE_TILE_ROW

/* The (block_q, block_kv) pairs of head dim `dim` for one direction and rows per warp (16 or 32: query rows in the
 * forward, key rows in the backward), or of the wgmma kernels (mma 1: warp_rows not read), in list order:
 * writes up to max_pairs of them to tiles (when not NULL) and returns how many there are. */
static inline int native_tile_pairs(int dim, int backward, int warp_rows, int mma, int32_t *tiles, int max_pairs) {
#define NATIVE_LIST(x) list = x, n = (int)(sizeof x / sizeof *x)
    const int32_t(*list)[3];
    int n;
    if (mma) {
        if (backward) NATIVE_LIST(native_backward_tiles_wgmma); else NATIVE_LIST(native_forward_tiles_wgmma);
    } else if (backward) {
        if (warp_rows == 32) NATIVE_LIST(native_backward_tiles_32); else NATIVE_LIST(native_backward_tiles);
    } else {
        if (warp_rows == 32) NATIVE_LIST(native_forward_tiles_32); else NATIVE_LIST(native_forward_tiles);
    }
#undef NATIVE_LIST
    int count = 0;
    for (int i = 0; i < n; i++) {
        if (list[i][0] != dim) continue;
        if (tiles && count < max_pairs) tiles[2 * count] = list[i][1], tiles[2 * count + 1] = list[i][2];
        count++;
    }
    return count;
}

static inline fadev_status native_bad(fadev_status st, const char *message) {
    return fadev_cuda_fail_msg(st, message);
}

/* The end of an entry point (fadev_cuda_end): asynchronous on a caller's stream, or a device synchronisation. */
static inline fadev_status native_finish(const fadev_native_params *p, const char *where) {
    return fadev_cuda_end(p->asynchronous, where);
}

/* Shapes, tiles, dtype and sizes (both entry points; the grid bound is checked for the smallest tiles). */
static inline fadev_status native_validate(const fadev_native_params *p, int backward) {
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
    if (p->deterministic != 0 && p->deterministic != 1)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: deterministic must be 0 or 1");
    if (p->warp_rows != 0 && p->warp_rows != 16 && p->warp_rows != 32)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: warp_rows must be 16 or 32");
    if (p->mma != 0 && p->mma != 1)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: mma must be 0 (mma.sync) or 1 (wgmma)");
    int32_t pairs[2 * 64];
    const int n = native_tile_pairs((int)p->attn.dim, backward, p->warp_rows == 32 ? 32 : 16, p->mma, pairs, 64);
    int found = 0;
    for (int i = 0; i < n && i < 64; i++) found |= pairs[2 * i] == p->attn.block_q && pairs[2 * i + 1] == p->attn.block_kv;
    if (!found)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT,
                          backward ? "native attention: (block_q, block_kv) is not a compiled backward tile (see "
                                     "fadev_cuda_native_tiles)"
                                   : "native attention: (block_q, block_kv) is not a compiled forward tile (see "
                                     "fadev_cuda_native_tiles)");
    if (p->strided != 0 && p->strided != 1)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: strided must be 0 or 1");
    for (int t = 0; p->strided && t < (backward ? FADEV_NATIVE_TENSORS : FADEV_NATIVE_DOUT); t++)
        for (int i = 0; i < 3; i++)
            if (p->strides[t][i] < 0 || p->strides[t][i] >= ((int64_t)1 << 48) || p->strides[t][i] % 8)
                return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: strides must be multiples of 8 "
                                                              "elements (16 bytes) in [0, 2^48)");
    for (int t = 0; p->strided && t < (backward ? FADEV_NATIVE_TENSORS : FADEV_NATIVE_DOUT); t++) {
        /* the last element's offset, (B - 1) sb + (H - 1) sh + (N - 1) sr + D, must fit int64 (kernels index in it) */
        const int kv = t == FADEV_NATIVE_K || t == FADEV_NATIVE_V || t == FADEV_NATIVE_DK || t == FADEV_NATIVE_DV;
        const int64_t size[3] = {p->attn.batch, kv ? p->attn.heads_kv : p->attn.heads, kv ? p->attn.seq_kv : p->attn.seq_q};
        int64_t room = ((int64_t)1 << 62) - p->attn.dim;
        for (int i = 0; i < 3; i++) {
            if (p->strides[t][i] && size[i] - 1 > room / p->strides[t][i])
                return native_bad(FADEV_ERR_OVERFLOW, "native attention: a tensor's strides reach past 2^62 elements");
            room -= (size[i] - 1) * p->strides[t][i];
        }
    }
    if (p->attn.seq_q > NATIVE_MAX_SEQ || p->attn.seq_kv > NATIVE_MAX_SEQ)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: seq_q and seq_kv must be <= 2^30");
    /* grids are 1-D: batch * heads * query tiles (forward; the backward's dQ pass, whose tiles have at most
     * NATIVE_DQ_BLOCK_Q rows), batch * heads_kv * key tiles (backward) */
    const int64_t bq = p->attn.block_q < NATIVE_DQ_BLOCK_Q ? p->attn.block_q : NATIVE_DQ_BLOCK_Q;
    const int64_t grid_max = INT32_MAX, n_qt = (p->attn.seq_q + bq - 1) / bq,
                  n_kt = (p->attn.seq_kv + p->attn.block_kv - 1) / p->attn.block_kv;
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

/* One backward kernel on the call's stream with `smem` bytes of dynamic shared memory (the attribute set first: above
 * 48 KB it must be); every backward launcher's launch (the dK/dV kernels, both dQ passes). */
static inline fadev_status native_bwd_launch(void (*kernel)(native_bwd_args), int64_t ctas, int threads, int smem,
                                             const native_bwd_args &a) {
    FADEV_TRY(fadev_cuda_smem_attr((const void *)kernel, (int)smem));
    kernel<<<(unsigned)ctas, threads, smem, a.stream>>>(a);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

/* The layout of tensor t (fadev_native_tensor) of a call: its strides, or contiguous (B, H, N, D). */
static inline native_strides native_layout(const fadev_native_params *p, int t) {
    if (p->strided) return {p->strides[t][0], p->strides[t][1], p->strides[t][2]};
    const int kv = t == FADEV_NATIVE_K || t == FADEV_NATIVE_V || t == FADEV_NATIVE_DK || t == FADEV_NATIVE_DV;
    const int64_t n = kv ? p->attn.seq_kv : p->attn.seq_q, heads = kv ? p->attn.heads_kv : p->attn.heads;
    return {heads * n * p->attn.dim, n * p->attn.dim, p->attn.dim};
}

#endif /* FADEV_NATIVE_CUH */
