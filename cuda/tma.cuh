/* Hopper's tensor memory accelerator for the native wgmma kernels (native_forward_tma_wgmma.cu,
 * native_backward_wgmma.cu): mbarriers, the bulk tensor copies of a head's rows in wgmma's 128-byte-swizzled panels
 * (wgmma.cuh), and the host's tensor maps of a (batch, heads, rows, D) tensor. */
#ifndef FADEV_TMA_CUH
#define FADEV_TMA_CUH

#include <cuda.h>
#include <cudaTypedefs.h>

#include "native.cuh"

namespace {

/* mbarriers (PTX ISA 8.0): arrival counts, expected transaction bytes, phase-parity waits */
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* until the phase of parity `parity` has completed (a fresh barrier: parity 1 counts as completed) */
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
/* one box of a 4-D tensor map (D, rows, heads, batch) into shared memory at dst, completing on bar */
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap *map, uint32_t bar, int col, int row, int head,
                                         int batch) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
                 "%4, %5}], [%6];\n" ::"r"(dst),
                 "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(bar)
                 : "memory");
}
/* ROWS rows of a head as D / 64 panels of 64 columns (one box each) */
template <int D, int ROWS>
__device__ __forceinline__ void tma_rows(uint32_t dst, const CUtensorMap *map, uint32_t bar, int row, int head,
                                         int batch) {
#pragma unroll
    for (int p = 0; p < D / 64; ++p) tma_load(dst + p * ROWS * 128, map, bar, p * 64, row, head, batch);
}
/* named barriers 1..: bar.sync waits for `count` threads' arrivals (its own included), bar.arrive only arrives */
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

/* The mbarriers of a producer / consumer pipeline at `base` (8-byte aligned shared memory, (1 + 4 STAGES) * 8
 * bytes): one for the tiles loaded once (Q), and per stage of K and V a "full" (the copy engine's bytes arrived) and
 * an "empty" (every consumer thread released it) barrier. */
template <int STAGES> struct kv_barriers {
    uint32_t base;
    static constexpr int BYTES = (1 + 4 * STAGES) * 8;
    __device__ __forceinline__ uint32_t full_q() const { return base; }
    __device__ __forceinline__ uint32_t full_k(int st) const { return base + 8 * (1 + st); }
    __device__ __forceinline__ uint32_t full_v(int st) const { return base + 8 * (1 + STAGES + st); }
    __device__ __forceinline__ uint32_t empty_k(int st) const { return base + 8 * (1 + 2 * STAGES + st); }
    __device__ __forceinline__ uint32_t empty_v(int st) const { return base + 8 * (1 + 3 * STAGES + st); }
    /* by one thread, before a barrier of the CTA: full_q awaits one arrival (and the bytes), the stages' full ones
     * `full` (the producer's, with the bytes, and any others), the empty ones `consumers` */
    __device__ __forceinline__ void init(int consumers, int full = 1) const {
        mbar_init(full_q(), 1);
        for (int st = 0; st < STAGES; ++st)
            mbar_init(full_k(st), full), mbar_init(full_v(st), full), mbar_init(empty_k(st), consumers),
                mbar_init(empty_v(st), consumers);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
};

/* cuTensorMapEncodeTiled, looked up once through the runtime (NULL where the driver has none) */
PFN_cuTensorMapEncodeTiled_v12000 tma_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *f = nullptr;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess)
            f = nullptr;
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
    }();
    return fn;
}

/* The map of a (batch, heads, rows, D) tensor with strides s, read in boxes of 64 columns x box_rows rows with the
 * 128-byte swizzle; false where the copy engine cannot describe it. */
template <typename T>
bool tma_map(CUtensorMap *map, const void *base, const native_strides &s, int64_t batch, int64_t heads, int64_t rows,
             int d, int box_rows) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tma_encoder();
    if (!encode) return false;
    const cuuint64_t dims[4] = {(cuuint64_t)d, (cuuint64_t)rows, (cuuint64_t)heads, (cuuint64_t)batch};
    const cuuint64_t strides[3] = {(cuuint64_t)s.r * 2, (cuuint64_t)s.h * 2, (cuuint64_t)s.b * 2};
    for (cuuint64_t st : strides)
        if (st >= ((cuuint64_t)1 << 40)) return false;
    const cuuint32_t box[4] = {64, (cuuint32_t)box_rows, 1, 1}, one[4] = {1, 1, 1, 1};
    const CUtensorMapDataType type =
        std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    return encode(map, type, 4, const_cast<void *>(base), dims, strides, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* The map of the atomic backward's fp32 dQ workspace (batch * heads, rows, d; contiguous), written by reductions in
 * boxes of box_cols columns x box_rows rows (no swizzle: the box lies row by row in shared memory). */
inline bool tma_map_f32(CUtensorMap *map, float *base, int64_t heads, int64_t rows, int d, int box_cols, int box_rows) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tma_encoder();
    if (!encode) return false;
    const cuuint64_t dims[3] = {(cuuint64_t)d, (cuuint64_t)rows, (cuuint64_t)heads};
    const cuuint64_t strides[2] = {(cuuint64_t)d * 4, (cuuint64_t)(rows * d) * 4};
    const cuuint32_t box[3] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows, 1}, one[3] = {1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, base, dims, strides, box, one, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
/* box (c0, c1, c2) of map += the box at src (shared memory), by the copy engine; a bulk group: commit, then wait
 * (.read: until src may be written again) */
__device__ __forceinline__ void tma_reduce_add(const CUtensorMap *map, uint32_t src, int c0, int c1, int c2) {
    asm volatile("cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n"
                 ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(src) : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

/* The backward kernels' maps (native_backward_tma_wgmma.cu, native_backward_dq_tma_wgmma.cu): Q and dO read in boxes
 * of q_rows rows, K and V of kv_rows, and with dq_cols the atomic dQ workspace reduced into in boxes of dq_cols x
 * q_rows; false where the copy engine cannot describe one of them. */
struct bwd_maps {
    CUtensorMap q, dout, k, v, dq;
};
template <typename T>
bool bwd_tma_maps(bwd_maps *m, const fadev_native_params *p, const native_bwd_args &a, int d, int q_rows, int kv_rows,
                  int dq_cols) {
    const int64_t B = p->attn.batch, H = p->attn.heads, Hk = p->attn.heads_kv;
    return tma_map<T>(&m->q, a.q, a.sq, B, H, a.seq_q, d, q_rows) &&
           tma_map<T>(&m->dout, a.dout, a.sdo, B, H, a.seq_q, d, q_rows) &&
           tma_map<T>(&m->k, a.k, a.sk, B, Hk, a.seq_kv, d, kv_rows) &&
           tma_map<T>(&m->v, a.v, a.sv, B, Hk, a.seq_kv, d, kv_rows) &&
           (!dq_cols || tma_map_f32(&m->dq, a.dq_acc, B * H, a.seq_q, d, dq_cols, q_rows));
}

/* Runs a backward producer / consumer kernel(a, maps) on `ctas` CTAs where the maps can be described (*ran true),
 * else leaves *ran false for the cp.async kernel. */
template <typename T>
fadev_status bwd_tma_run(void (*kernel)(native_bwd_args, bwd_maps), const fadev_native_params *p,
                         const native_bwd_args &a, int d, int q_rows, int kv_rows, int64_t ctas, int threads, int smem,
                         bool *ran, int dq_cols = 0) {
    bwd_maps maps;
    if (!bwd_tma_maps<T>(&maps, p, a, d, q_rows, kv_rows, dq_cols)) return FADEV_OK;
    FADEV_TRY(fadev_cuda_smem_attr((const void *)kernel, (int)smem));
    kernel<<<(unsigned)ctas, threads, smem, a.stream>>>(a, maps);
    CUDA_TRY(cudaGetLastError());
    *ran = true;
    return FADEV_OK;
}

} // namespace

#endif /* FADEV_TMA_CUH */
