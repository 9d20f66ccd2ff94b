/* The wgmma backward's dK/dV kernel with FlashAttention-3's division of labour at block_q 64, block_kv 128 (D 64 and
 * 128; deterministic: dQ by the dq pass; atomic: below) where the copy engine can describe the layout
 * (native_backward_wgmma.cu's cp.async kernel otherwise): one CTA per (batch, K/V head, 128 keys) of three
 * warpgroups,
 *   warpgroup 0, the producer: thread 0 issues the tensor memory accelerator's copies of the tile's K and V (once)
 *     and of each query tile's Q and dO into BWD_STAGES stages, warp 1 copies the query tile's lse and Dvec beside
 *     them ("full" / "empty" mbarriers, as native_forward_tma_wgmma.cu's);
 *   warpgroups 1 and 2, the consumers: keys [64 c, 64 c + 64) of the tile each, the cp.async kernel's steps
 *     (native_backward_wgmma.cuh) in its order, so the same bits: S^T = K Q^T and dP^T = V dO^T (one wgmma group),
 *     P^T and dS^T, dV += round(P^T) dO and dK += round(dS^T) Q, each product group waited for in its turn; no
 *     CTA-wide barrier between query tiles (a stage is released by its consumers' mbarrier arrivals), and the two
 *     consumers take turns at issuing (named barriers: ping-pong), so that one's softmax runs while the other's
 *     products are on the tensor cores.
 * Every query tile is two turns of each consumer (a causal tile that none of a consumer's keys sees gives P = 0), so
 * the turns pair up. The atomic mode (dQ added to the fp32 workspace, as FlashAttention-2 and the cp.async kernel)
 * sums tile j's dQ in this kernel from both consumers' dS^T of j in shared memory, each consumer half the head dim,
 * after its tile j + 1's products, and hands it to the copy engine's reduce-add (ATOMIC; two stages, for shared
 * memory). FADEV_NATIVE_TMA_BWD=0 runs the cp.async kernel instead (tests compare the two: bit for bit where
 * deterministic). */
#include <stdlib.h>
#include <string.h>

#include "native.cuh"
#include "native_backward_wgmma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace {

/* 3 stages of Q, dO, lse and Dvec: at D 64 two left the consumers waiting (H200: 10-20% slower than three, with the
 * next tile's S^T and dP^T issued beside this tile's dV and dK products); at D 128 the two measured the same */
constexpr int BWD_THREADS = 384, BWD_BQ = 64, BWD_BKV = 128, BWD_STAGES = 3;

/* the atomic mode's dS^T buffers (BKV x 64 each): a consumer computes tile j's dQ product after tile j + 1's second
 * turn, and the buffer is written again at tile j + 3 (the other consumer's product of j is done by then) */
constexpr int BWD_DS = 3;

template <int D, int S, bool ATOMIC> constexpr int bwd_tma_smem() {
    return (2 * BWD_BKV + 2 * S * BWD_BQ + (ATOMIC ? BWD_DS * BWD_BKV * BWD_BQ / D : 0)) * D * 2 +
           (ATOMIC ? BWD_BQ * D * 4 : 0) + 2 * S * BWD_BQ * 4 + 1024 + kv_barriers<S>::BYTES;
}

template <typename T, int D, int S, bool ATOMIC>
__global__ void __launch_bounds__(BWD_THREADS, 1)
    native_backward_tma_kernel(const native_bwd_args a, const __grid_constant__ bwd_maps maps) {
#if FADEV_WGMMA
    constexpr int BQ = BWD_BQ, BKV = BWD_BKV;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* the swizzle atoms must be 1024-byte aligned (wgmma.cuh) */
    T *sK = reinterpret_cast<T *>(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u));
    T *sV = sK + BKV * D, *sQ = sV + BKV * D, *sdO = sQ + S * BQ * D;
    T *sdS = sdO + S * BQ * D; /* ATOMIC: BWD_DS buffers of dS^T, then each consumer's dQ box (BQ x D / 2 fp32) */
    float *sdq = reinterpret_cast<float *>(sdS + (ATOMIC ? BWD_DS * BKV * BQ : 0));
    float *sL = sdq + (ATOMIC ? BQ * D : 0), *sDv = sL + S * BQ;
    /* full_q: K and V; stage st: full_k (Q and dO's bytes, and warp 1's 32 arrivals with lse, Dvec), empty_k */
    const kv_barriers<S> bar{smem_u32(sDv + S * BQ)};
    const bwd_tile<T, D, BKV, BQ> tile(a);
    const int tid = threadIdx.x, n_it = tile.n_it;
    if (tid == 0) bar.init(256, 33);
    __syncthreads();

    if (tid < 128) { /* the producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n"); /* 24 + 2 x 240: the CTA's 384 x 168 registers */
        const int b = (int)tile.b, hk = (int)tile.hk;
        /* iteration it = query head hk * group + hi, query tile qt_start + it % per_head, in stage st (phase ph):
         * counted, not divided (the producer's 32 registers) */
        auto each_tile = [&](auto &&f) {
            int st = 0, ph = 0;
            for (int hi = 0; hi < a.group; ++hi)
                for (int qt = tile.qt_start; qt < tile.qt_start + tile.per_head; ++qt) {
                    mbar_wait(bar.empty_k(st), ph ^ 1);
                    f(hk * a.group + hi, qt * BQ, st);
                    if (++st == S) st = 0, ph ^= 1;
                }
        };
        if (tid == 0 && n_it > 0) {
            mbar_expect_tx(bar.full_q(), 2 * BKV * D * 2);
            tma_rows<D, BKV>(smem_u32(sK), &maps.k, bar.full_q(), tile.k0, hk, b);
            tma_rows<D, BKV>(smem_u32(sV), &maps.v, bar.full_q(), tile.k0, hk, b);
            each_tile([&](int h, int q0, int st) {
                mbar_expect_tx(bar.full_k(st), 2 * BQ * D * 2);
                tma_rows<D, BQ>(smem_u32(sQ + st * BQ * D), &maps.q, bar.full_k(st), q0, h, b);
                tma_rows<D, BQ>(smem_u32(sdO + st * BQ * D), &maps.dout, bar.full_k(st), q0, h, b);
            });
        } else if (tid >= 32 && tid < 64) {
            const int lane = tid - 32;
            each_tile([&](int h, int q0, int st) {
                const int64_t row = ((int64_t)b * a.heads + h) * a.seq_q + q0;
#pragma unroll
                for (int r = lane; r < BQ; r += 32) { /* rows past the end: 0, as the cp.async kernel's zero fill */
                    const bool ok = q0 + r < a.seq_q;
                    sL[st * BQ + r] = ok ? a.lse[row + r] : 0.f;
                    sDv[st * BQ + r] = ok ? a.dvec[row + r] : 0.f;
                }
                mbar_arrive(bar.full_k(st));
            });
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int ct = tid - 128, lane = ct & 31, warp = ct >> 5, cw = warp >> 2, g = lane >> 2, t4 = lane & 3;
    const int k0 = tile.k0, key0 = k0 + warp * 16 + g; /* as the cp.async kernel's warp `warp` */
    const uint32_t aK = smem_u32(sK) + cw * 64 * 128, aV = smem_u32(sV) + cw * 64 * 128; /* this consumer's rows */
    /* ping-pong (each consumer 2 n_it turns): issue between bar.sync on 3 + cw and bar.arrive on the other's */
    int turns = 0;
    auto turn = [&]() { named_sync(3 + cw, 256); };
    auto pass = [&]() {
        if (!(cw == 1 && ++turns == 2 * n_it)) named_arrive(3 + (cw ^ 1), 256);
    };
    if (n_it > 0 && cw == 1) named_arrive(3, 256); /* consumer 0 issues first */

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
    /* ATOMIC: tile j's dQ[.][DN cw .. + DN] (the head dim split over the consumers) from both consumers' dS^T of j,
     * after tile j + 1's dV and dK products (in their turn, its 32 registers beside theirs and P^T, dS^T's exceed 240
     * at D 128) and added to the workspace. ds_bar(c, j): consumer c's dS^T of tile j stored (c arrives, the other
     * waits); two barriers a consumer, by the tile's parity, since c may store tile j + 1's before the other has
     * waited for j's (not j + 2's: that needs the other's turns of tile j + 1) */
    auto ds_bar = [](int c, int j) { return 5 + c + 2 * (j & 1); };
    constexpr int DN = D / 2;
    float dq[DN / 2];
    auto dq_issue = [&](int j) {
        bwd_issue_dq<T, DN, BKV>(dq, smem_u32(sdS + j % BWD_DS * BKV * BQ), smem_u32(sK), cw * DN);
    };
    /* the product through shared memory (this consumer's box, free once its last reduction has read it: barrier
     * 9 + cw, the consumer's own) to the copy engine's reduce-add into the workspace (rows past the end: not
     * written) */
    float *box = sdq + cw * BQ * DN;
    const bool leader = (ct & 127) == 0;
    auto dq_add = [&](int j) {
        wgmma_fence_regs(dq);
        if (leader) bulk_wait_read();
        named_sync(9 + cw, 128);
#pragma unroll
        for (int nb = 0; nb < DN / 8; ++nb)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                *reinterpret_cast<float2 *>(box + ((warp & 3) * 16 + g + 8 * r) * DN + nb * 8 + 2 * t4) =
                    make_float2(dq[4 * nb + 2 * r], dq[4 * nb + 2 * r + 1]);
        fence_proxy_async();
        named_sync(9 + cw, 128);
        if (leader) tma_reduce_add(&maps.dq, smem_u32(box), cw * DN, tile.first_row(j), (int)tile.head_of(a, j));
    };
    if (n_it > 0) mbar_wait(bar.full_q(), 0);
    /* each wgmma group is waited for in its own step: none in flight across the loop's back edge, where ptxas would
     * serialise it; and at D 128 S^T, dP^T of the next tile beside this tile's P^T, dS^T would exceed 240 registers
     * (at D 64, that pairing measured no faster) */
    for (int it = 0; it < n_it; ++it) {
        const int st = it % S;
        const uint32_t aQ = smem_u32(sQ + st * BQ * D), adO = smem_u32(sdO + st * BQ * D);
        mbar_wait(bar.full_k(st), (it / S) & 1);
        float sp[BQ / 2], dp[BQ / 2];
        turn();
        wgmma_score_pair<T, BQ, D, BKV, BQ>(sp, dp, aK, aQ, aV, adO); /* S^T = K Q^T, dP^T = V dO^T */
        pass();
        wgmma_wait_all();
        wgmma_fence_regs(sp);
        wgmma_fence_regs(dp);
        bwd_ds_tile<BQ, BKV>(a, sp, dp, sL + st * BQ, sDv + st * BQ, tile.first_row(it), k0, tile.off, key0, t4);
        uint32_t pa[BQ / 16][4], sa[BQ / 16][4];
        wgmma_pack_a<T, BQ>(pa, sp);
        wgmma_pack_a<T, BQ>(sa, dp);
        if constexpr (ATOMIC) { /* this consumer's dS^T of tile it, for both consumers' dQ products */
            bwd_store_ds<T, BKV, BQ>(sdS + it % BWD_DS * BKV * BQ, sa, warp * 16, g, t4);
            fence_proxy_async();
            named_arrive(ds_bar(cw, it), 256);
            if (it > 0) named_sync(ds_bar(cw ^ 1, it - 1), 256); /* the other's dS^T of tile it - 1 */
        }
        turn();
        bwd_issue_dkdv<T, D, BQ>(dk, dv, pa, sa, aQ, adO);
        pass();
        wgmma_wait_all();
        wgmma_fence_regs(dk);
        wgmma_fence_regs(dv);
        mbar_arrive(bar.empty_k(st)); /* the tile's stage is read no more */
        if constexpr (ATOMIC) {
            if (it > 0) {
                dq_issue(it - 1);
                wgmma_wait_all();
                dq_add(it - 1);
            }
        }
    }
    if constexpr (ATOMIC) { /* the last tile's dQ */
        if (n_it > 0) {
            named_sync(ds_bar(cw ^ 1, n_it - 1), 256);
            dq_issue(n_it - 1);
            wgmma_wait_all();
            dq_add(n_it - 1);
            if (leader) bulk_wait(); /* the reductions done before the CTA ends */
        }
    }
    bwd_store_dkdv<T, D>(a, tile.b, tile.hk, key0, t4, dk, dv);
#else
    __trap(); /* not an sm_90a build: never launched (the wgmma backward checks the device) */
#endif
}

template <typename T, int D>
fadev_status bwd_tma_launch(const fadev_native_params *p, const native_bwd_args &a, bool *ran) {
    const int64_t ctas = p->attn.batch * p->attn.heads_kv * a.n_kt;
    if (a.dq_acc) /* two stages: the dS^T and dQ buffers take the third's shared memory */
        return bwd_tma_run<T>(native_backward_tma_kernel<T, D, 2, true>, p, a, D, BWD_BQ, BWD_BKV, ctas, BWD_THREADS,
                              bwd_tma_smem<D, 2, true>(), ran, D / 2);
    return bwd_tma_run<T>(native_backward_tma_kernel<T, D, BWD_STAGES, false>, p, a, D, BWD_BQ, BWD_BKV, ctas,
                          BWD_THREADS, bwd_tma_smem<D, BWD_STAGES, false>(), ran);
}

} // namespace

fadev_status native_backward_tma(const fadev_native_params *p, const native_bwd_args &a, bool *ran) {
    *ran = false;
    const char *off = getenv("FADEV_NATIVE_TMA_BWD");
    if ((off && strcmp(off, "0") == 0) || p->attn.block_q != BWD_BQ || p->attn.block_kv != BWD_BKV)
        return FADEV_OK;
    if (p->attn.dim == 64)
        return p->dtype == FADEV_NATIVE_FP16 ? bwd_tma_launch<__half, 64>(p, a, ran)
                                             : bwd_tma_launch<__nv_bfloat16, 64>(p, a, ran);
    if (p->attn.dim == 128)
        return p->dtype == FADEV_NATIVE_FP16 ? bwd_tma_launch<__half, 128>(p, a, ran)
                                             : bwd_tma_launch<__nv_bfloat16, 128>(p, a, ran);
    return FADEV_OK;
}
