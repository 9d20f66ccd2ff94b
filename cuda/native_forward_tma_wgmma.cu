/* The native forward on Hopper with FlashAttention-3's division of labour (mma = 1 where the tile and the layout allow
 * it; native_forward_wgmma.cu otherwise): one CTA per (batch, head, 128 query rows) of three warpgroups,
 *   warpgroup 0, the producer: one thread issues the tensor memory accelerator's tile copies (cp.async.bulk.tensor,
 *     128-byte swizzle: the wgmma layout of wgmma.cuh) of Q, and of K and V into STAGES stages, each completing on
 *     its stage's "full" mbarrier; it waits on a stage's "empty" mbarrier before refilling it. Its registers go to
 *     the consumers (setmaxnreg).
 *   warpgroups 1 and 2, the consumers: 64 query rows each, the cp.async kernel's loop (the scores of tile j + 1
 *     issued before P_j V_j, the softmax of j + 1 while P_j V_j runs) on the same fragments with the same functions
 *     (native_forward_wgmma.cuh), so the same bits; they release K_j once its scores are done and V_j once P_j V_j
 *     is, and take turns at issuing their products (named barriers, FlashAttention-3's ping-pong: one warpgroup's
 *     softmax runs while the other's products hold the tensor cores).
 * No thread issues a copy instruction per 16 bytes any more, and the consumers hold 240 registers (the cp.async
 * kernel: 214 of 255 for all 256 threads, loads included).
 * The tensor maps are encoded on the host for each call (cuTensorMapEncodeTiled through the runtime's driver entry
 * point: no link against libcuda); a layout they cannot describe (a stride past 2^40 bytes) runs the cp.async kernel.
 * Rows past the end of Q, K, V are zero-filled by the copy engine, as cp.async zero-fills them. */
#include "native_forward_wgmma.cuh"
#include "tma.cuh"

/* FADEV_TMA_PINGPONG 0 (setup.py's FADEV_NVCC_FLAGS): the consumers issue their products whenever they are ready
 * (the same bits; for timing the choice: ping-pong measured 2-16% faster, benchmarks/README.md) */
#ifndef FADEV_TMA_PINGPONG
#define FADEV_TMA_PINGPONG 1
#endif

namespace {

struct tma_maps {
    CUtensorMap q, k, v;
};

constexpr int TMA_BQ = 128, TMA_THREADS = 384;

template <int D, int BKV, int STAGES> constexpr int tma_smem() {
    return (TMA_BQ + 2 * STAGES * BKV) * D * 2 + 1024 + kv_barriers<STAGES>::BYTES;
}

template <typename T, int D, int BKV, int STAGES, bool PP>
__global__ void __launch_bounds__(TMA_THREADS, 1)
    native_forward_tma_kernel(const native_fwd_args a, const __grid_constant__ tma_maps maps) {
#if FADEV_WGMMA
    constexpr int BQ = TMA_BQ, KV_BYTES = BKV * D * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* the swizzle atoms must be 1024-byte aligned (wgmma.cuh) */
    T *sQ = reinterpret_cast<T *>(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u));
    T *sK = sQ + BQ * D, *sV = sK + STAGES * BKV * D;
    const kv_barriers<STAGES> bar{smem_u32(sV + STAGES * BKV * D)};
    const int tid = threadIdx.x;

    const fwd_tile<T, D, BQ, BKV> tile(a);
    const int q0 = tile.q0, off = tile.off, n_kt = tile.n_kt;
    if (n_kt == 0) return tile.template write_empty<TMA_THREADS>(a, tid);
    if (tid == 0) bar.init(256);
    __syncthreads();

    if (tid < 128) { /* the producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid == 0) {
            const int bh = (int)(blockIdx.x / a.n_qt), b = bh / a.heads, h = bh % a.heads, hk = h / a.group;
            mbar_expect_tx(bar.full_q(), BQ * D * 2);
            tma_rows<D, BQ>(smem_u32(sQ), &maps.q, bar.full_q(), q0, h, b);
            for (int j = 0; j < n_kt; ++j) {
                const int st = j % STAGES;
                const uint32_t ph = ((j / STAGES) & 1) ^ 1;
                mbar_wait(bar.empty_k(st), ph);
                mbar_expect_tx(bar.full_k(st), KV_BYTES);
                tma_rows<D, BKV>(smem_u32(sK + st * BKV * D), &maps.k, bar.full_k(st), j * BKV, hk, b);
                mbar_wait(bar.empty_v(st), ph);
                mbar_expect_tx(bar.full_v(st), KV_BYTES);
                tma_rows<D, BKV>(smem_u32(sV + st * BKV * D), &maps.v, bar.full_v(st), j * BKV, hk, b);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    /* consumer warpgroup cw (0, 1): rows [64 cw, 64 cw + 64) of the tile; warp rows as the cp.async kernel's */
    const int ct = tid - 128, lane = ct & 31, warp = ct >> 5, cw = warp >> 2, g = lane >> 2, t4 = lane & 3;
    const int wrow = warp * 16;
    /* ping-pong: consumer cw issues its products between bar.sync on barrier 3 + cw and bar.arrive on the other's */
    auto turn = [&]() { if constexpr (PP) named_sync(3 + cw, 256); };
    auto pass = [&](bool last) { if constexpr (PP) if (!(last && cw == 1)) named_arrive(3 + (cw ^ 1), 256); };
    if constexpr (PP) if (cw == 1) named_arrive(3, 256); /* consumer 0 issues first */

    const row_limits<BKV> rl(a, q0, off, wrow, g);

    float o[D / 2], s[BKV / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2], sum[2];
    uint32_t pa[BKV / 16][4];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    const uint32_t aQ = smem_u32(sQ) + cw * 64 * 128; /* this warpgroup's 64 rows of each Q panel */

    mbar_wait(bar.full_q(), 0);
    uint32_t qf[wgmma_qreg<D, BQ> ? D / 16 : 1][4];
    if constexpr (wgmma_qreg<D, BQ>) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            ldmatrix_x4(qf[kk], sQ + wswz<BQ>(wrow + (lane & 15), kk * 2 + (lane >> 4)));
    }
    mbar_wait(bar.full_k(0), 0);
    turn();
    issue_scores<T, D, BQ, BKV>(s, qf, aQ, smem_u32(sK));
    pass(false);
    wgmma_wait_all();
    wgmma_fence_regs(s);
    mbar_arrive(bar.empty_k(0));
    tile_softmax<BKV>(s, m, alpha, sum, a.scale_log2, rl.masked(0), 0, t4, rl.lim);
    l[0] = sum[0], l[1] = sum[1];
    wgmma_pack_a<T, BKV>(pa, s);

    for (int j = 0; j + 1 < n_kt; ++j) {
        const int sj = j % STAGES, sn = (j + 1) % STAGES;
        mbar_wait(bar.full_k(sn), ((j + 1) / STAGES) & 1);
        mbar_wait(bar.full_v(sj), (j / STAGES) & 1);
        turn();
        issue_scores<T, D, BQ, BKV>(s, qf, aQ, smem_u32(sK + sn * BKV * D));
        issue_pv<T, D, BKV>(o, pa, smem_u32(sV + sj * BKV * D));
        pass(false);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); /* the scores; P_j V_j may run on */
        wgmma_fence_regs(s);
        mbar_arrive(bar.empty_k(sn));
        tile_softmax<BKV>(s, m, alpha, sum, a.scale_log2, rl.masked(j + 1), (j + 1) * BKV, t4, rl.lim);
        wgmma_wait_all();
        wgmma_fence_regs(o);
        mbar_arrive(bar.empty_v(sj));
        rescale_o<D>(o, l, alpha, sum);
        wgmma_pack_a<T, BKV>(pa, s);
    }
    const int sl = (n_kt - 1) % STAGES;
    mbar_wait(bar.full_v(sl), ((n_kt - 1) / STAGES) & 1);
    turn();
    issue_pv<T, D, BKV>(o, pa, smem_u32(sV + sl * BKV * D));
    pass(true);
    wgmma_wait_all();
    wgmma_fence_regs(o);

    /* every product of this warpgroup is done before its Q rows are overwritten (store_out stages O there) */
    named_sync(1 + cw, 128);
    store_out<T, D, BQ>(o, m, l, sQ, tile.O, tile.L, q0, wrow, lane, a.seq_q);
#else
    __trap(); /* not an sm_90a build: never launched (native_forward_wgmma checks the device) */
#endif
}

template <typename T, int D, int BKV, int STAGES, bool PP = FADEV_TMA_PINGPONG != 0>
fadev_status tma_launch(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas, bool *ran) {
    tma_maps maps;
    const int64_t B = p->attn.batch, H = p->attn.heads, Hk = p->attn.heads_kv;
    if (!tma_map<T>(&maps.q, a.q, a.sq, B, H, a.seq_q, D, TMA_BQ) ||
        !tma_map<T>(&maps.k, a.k, a.sk, B, Hk, a.seq_kv, D, BKV) ||
        !tma_map<T>(&maps.v, a.v, a.sv, B, Hk, a.seq_kv, D, BKV))
        return FADEV_OK; /* *ran stays false: the cp.async kernel runs */
    constexpr int smem = tma_smem<D, BKV, STAGES>();
    auto kernel = native_forward_tma_kernel<T, D, BKV, STAGES, PP>;
    FADEV_TRY(fadev_cuda_smem_attr((const void *)kernel, (int)smem));
    kernel<<<(unsigned)ctas, TMA_THREADS, smem, a.stream>>>(a, maps);
    CUDA_TRY(cudaGetLastError());
    *ran = true;
    return FADEV_OK;
}

/* the tiles with 128 query rows; stages: as many as fit 227 KB (two of 128 keys at D 128, FlashAttention-3's) */
template <typename T>
fadev_status tma_dispatch(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas, bool *ran) {
    const int d = (int)p->attn.dim, bkv = p->attn.block_kv;
    if (p->attn.block_q != TMA_BQ) return FADEV_OK;
    if (d == 128 && bkv == 128) return tma_launch<T, 128, 128, 2>(p, a, ctas, ran);
    if (d == 128 && bkv == 64) return tma_launch<T, 128, 64, 3>(p, a, ctas, ran);
    if (d == 64 && bkv == 128) return tma_launch<T, 64, 128, 3>(p, a, ctas, ran);
    if (d == 64 && bkv == 64) return tma_launch<T, 64, 64, 3>(p, a, ctas, ran);
    return FADEV_OK;
}

} // namespace

fadev_status native_forward_tma(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas, bool *ran) {
    *ran = false;
    return p->dtype == FADEV_NATIVE_FP16 ? tma_dispatch<__half>(p, a, ctas, ran)
                                         : tma_dispatch<__nv_bfloat16>(p, a, ctas, ran);
}
