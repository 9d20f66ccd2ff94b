/* The deterministic backward's dQ pass with FlashAttention-3's division of labour (the wgmma backward's at D 128,
 * where the copy engine can describe the layout; native_backward_dq_wgmma.cu otherwise): one CTA per (batch, head,
 * 128 query rows) of three warpgroups,
 *   warpgroup 0, the producer: one thread issues the tensor memory accelerator's copies of the tile's Q and dO, and
 *     of K and V into DQ_STAGES stages ("full" / "empty" mbarriers, as native_forward_tma_wgmma.cu's);
 *   warpgroups 1 and 2, the consumers: 64 query rows each, the cp.async pass's dq_tile (native.cuh) with its
 *     products issued as that pass issues them, so the same bits: for K/V tile j in key order
 *       S = Q Kj^T, dP = dO Vj^T (one wgmma group), dS = P (dP - Dvec) (dq_tile::ds_tile), dQ += round(dS) Kj;
 *     tile j + 1's S and dP are issued beside tile j's dQ product (their dS runs while it is on the tensor cores),
 *     and the two consumers take turns at issuing (named barriers: ping-pong).
 * A causal CTA's upper consumer sees fewer K/V tiles than the lower; it drains the stages it does not use (waits for
 * each to fill, then releases it) and takes its turns, so the producer and the ping-pong see both consumers at every
 * tile. */
#include "native.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace {

constexpr int DQ_THREADS = 384, DQ_ROWS = 128, DQ_BKV = 64, DQ_STAGES = 3;

template <int D> constexpr int dq_tma_smem() {
    return (2 * DQ_ROWS + 2 * DQ_STAGES * DQ_BKV) * D * 2 + 1024 + kv_barriers<DQ_STAGES>::BYTES;
}

/* dQ += round(dS) Kj: A = dS (key chunk kk, registers), B = Kj MN-major (keys kk * 16 .. at byte 2048 kk, the
 * 64-column panels BKV * 128 bytes apart); committed as one wgmma group, not waited for */
template <typename T, int D>
__device__ __forceinline__ void issue_dq(float (&dq)[D / 2], const uint32_t (&da)[DQ_BKV / 16][4], uint32_t aK) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < DQ_BKV / 16; ++kk)
        wgmma_rs<T, D, 1>(dq, da[kk], wgmma_desc(aK + kk * 2048, DQ_BKV * 128, 1024), 1);
    wgmma_commit();
}

template <typename T, int D>
__global__ void __launch_bounds__(DQ_THREADS, 1)
    native_dq_tma_kernel(const native_bwd_args a, const __grid_constant__ bwd_maps maps) {
#if FADEV_WGMMA
    constexpr int BKV = DQ_BKV, S = DQ_STAGES, KV_BYTES = BKV * D * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* the swizzle atoms must be 1024-byte aligned (wgmma.cuh) */
    T *sQ = reinterpret_cast<T *>(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u));
    T *sdO = sQ + DQ_ROWS * D, *sK = sdO + DQ_ROWS * D, *sV = sK + S * BKV * D;
    const kv_barriers<S> bar{smem_u32(sV + S * BKV * D)};
    auto aK = [&](int j) { return smem_u32(sK + j % S * BKV * D); };
    auto aV = [&](int j) { return smem_u32(sV + j % S * BKV * D); };
    const int tid = threadIdx.x;
    const int n_qt = (a.seq_q + DQ_ROWS - 1) / DQ_ROWS, qt = n_qt - 1 - (int)(blockIdx.x % n_qt);
    const int64_t bh = blockIdx.x / n_qt;
    /* the CTA's K/V tiles: those its lower 64 rows see (as many as any of its rows) */
    const int n_kt = dq_tile<T, D, 64, BKV>(a, 0, 0, bh, 2 * qt + 1).n_kt;
    if (tid == 0) bar.init(256);
    __syncthreads();

    if (tid < 128) { /* the producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
        if (tid == 0 && n_kt > 0) {
            const int b = (int)(bh / a.heads), h = (int)(bh % a.heads), hk = h / a.group;
            mbar_expect_tx(bar.full_q(), 2 * DQ_ROWS * D * 2);
            tma_rows<D, DQ_ROWS>(smem_u32(sQ), &maps.q, bar.full_q(), qt * DQ_ROWS, h, b);
            tma_rows<D, DQ_ROWS>(smem_u32(sdO), &maps.dout, bar.full_q(), qt * DQ_ROWS, h, b);
            for (int j = 0; j < n_kt; ++j) {
                const int st = j % S;
                const uint32_t ph = ((j / S) & 1) ^ 1;
                mbar_wait(bar.empty_k(st), ph);
                mbar_expect_tx(bar.full_k(st), KV_BYTES);
                tma_rows<D, BKV>(aK(j), &maps.k, bar.full_k(st), j * BKV, hk, b);
                mbar_wait(bar.empty_v(st), ph);
                mbar_expect_tx(bar.full_v(st), KV_BYTES);
                tma_rows<D, BKV>(aV(j), &maps.v, bar.full_v(st), j * BKV, hk, b);
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    /* consumer cw (0, 1): rows [64 cw, 64 cw + 64) of the CTA's 128, as the cp.async pass's query tile 2 qt + cw */
    const int ct = tid - 128, lane = ct & 31, warp = ct >> 5, cw = warp >> 2, g = lane >> 2, t4 = lane & 3;
    const dq_tile<T, D, 64, BKV> tile(a, warp & 3, g, bh, 2 * qt + cw);
    const int my_kt = tile.n_kt;
    /* ping-pong (each consumer n_kt + 1 turns): issue between bar.sync on 3 + cw and bar.arrive on the other's */
    int turns = 0;
    auto turn = [&]() { named_sync(3 + cw, 256); };
    auto pass = [&]() {
        if (!(cw == 1 && ++turns == n_kt + 1)) named_arrive(3 + (cw ^ 1), 256);
    };
    if (n_kt > 0 && cw == 1) named_arrive(3, 256); /* consumer 0 issues first */
    const uint32_t aQ = smem_u32(sQ) + cw * 64 * 128, adO = smem_u32(sdO) + cw * 64 * 128; /* its rows' panels */

    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;
    if (my_kt > 0) {
        float s[BKV / 2], dp[BKV / 2];
        uint32_t da[BKV / 16][4];
        mbar_wait(bar.full_q(), 0);
        mbar_wait(bar.full_k(0), 0);
        mbar_wait(bar.full_v(0), 0);
        turn();
        wgmma_score_pair<T, BKV, D, DQ_ROWS, BKV>(s, dp, aQ, aK(0), adO, aV(0));
        pass();
        wgmma_wait_all();
        wgmma_fence_regs(s);
        wgmma_fence_regs(dp);
        mbar_arrive(bar.empty_v(0));
        tile.ds_tile(a, s, dp, 0, t4); /* dS in place of S */
        wgmma_pack_a<T, BKV>(da, s);
        for (int j = 0; j + 1 < my_kt; ++j) {
            const int n = j + 1;
            mbar_wait(bar.full_k(n % S), (n / S) & 1);
            mbar_wait(bar.full_v(n % S), (n / S) & 1);
            turn();
            wgmma_score_pair<T, BKV, D, DQ_ROWS, BKV>(s, dp, aQ, aK(n), adO, aV(n));
            issue_dq<T, D>(dq, da, aK(j));
            pass();
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); /* S, dP of tile j + 1 */
            wgmma_fence_regs(s);
            wgmma_fence_regs(dp);
            mbar_arrive(bar.empty_v(n % S));
            tile.ds_tile(a, s, dp, n, t4);
            wgmma_wait_all(); /* dQ += dS_j Kj */
            wgmma_fence_regs(dq);
            mbar_arrive(bar.empty_k(j % S));
            wgmma_pack_a<T, BKV>(da, s);
        }
        turn();
        issue_dq<T, D>(dq, da, aK(my_kt - 1));
        pass();
        wgmma_wait_all();
        wgmma_fence_regs(dq);
        mbar_arrive(bar.empty_k((my_kt - 1) % S));
    } else if (n_kt > 0) { /* this consumer's rows see no key: its one turn of the first tile */
        turn();
        pass();
    }
    for (int j = my_kt; j < n_kt; ++j) { /* the tiles only the other consumer's rows see */
        mbar_wait(bar.full_k(j % S), (j / S) & 1);
        mbar_wait(bar.full_v(j % S), (j / S) & 1);
        turn();
        pass();
        mbar_arrive(bar.empty_k(j % S));
        mbar_arrive(bar.empty_v(j % S));
    }
    tile.store_all(a, dq, t4);
#else
    __trap(); /* not an sm_90a build: never launched (the wgmma backward checks the device) */
#endif
}

template <typename T, int D>
fadev_status dq_tma_launch(const fadev_native_params *p, const native_bwd_args &a, bool *ran) {
    return bwd_tma_run<T>(native_dq_tma_kernel<T, D>, p, a, D, DQ_ROWS, DQ_BKV,
                          p->attn.batch * p->attn.heads * ((a.seq_q + DQ_ROWS - 1) / DQ_ROWS), DQ_THREADS,
                          dq_tma_smem<D>(), ran);
}

} // namespace

/* D 128 only: at D 64 it measured no faster than the cp.async pass (H100, benchmarks/README.md) */
fadev_status native_dq_pass_tma(const fadev_native_params *p, const native_bwd_args &a, bool *ran) {
    *ran = false;
    if (p->attn.dim != 128) return FADEV_OK;
    return p->dtype == FADEV_NATIVE_FP16 ? dq_tma_launch<__half, 128>(p, a, ran)
                                         : dq_tma_launch<__nv_bfloat16, 128>(p, a, ran);
}
