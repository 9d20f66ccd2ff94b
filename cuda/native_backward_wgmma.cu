/* The native backward's dK/dV kernel on Hopper's warpgroup MMA (mma = 1, "wgmma"): native_backward.cu's kernel 2,
 * the same arithmetic per element in the same order, its products issued by warpgroups as wgmma.m64nNk16 (wgmma.cuh).
 * Kernel 1 (Dvec) and 3 (dQ rounded, or the deterministic dQ pass: native_backward_dq_wgmma.cu) around it.
 *
 * One CTA per (batch, K/V head, block_kv keys), block_kv / 64 warpgroups; warpgroup w owns keys [64 w, 64 w + 64)
 * of the tile (warp w4 of it keys 16 w4 .. 16 w4 + 15 of those: the mma.sync kernel's per-warp rows), with their dK
 * and dV in fp32 registers. K and V sit in shared memory, Q, dO, lse and Dvec of the query tiles in two cp.async
 * stages, all in wgmma's 128-byte-swizzled panels. For each query tile (block_q rows: 64 at D 64, 32 or 64 at D 128) that
 * sees a key:
 *   S^T = K Q^T, dP^T = V dO^T   D / 16 wgmma each, A = this warpgroup's K / V rows, B = Q / dO (K-major)
 *   P^T, dS^T                    as the mma.sync kernel, on the same fragment layout (wgmma.cuh)
 *   dV += round(P^T) dO, dK += round(dS^T) Q    A from registers, B = dO / Q MN-major (transposed)
 *   dQ_i += round(dS) K          dS^T stored to shared memory, then (D 64) dQ = dS K: A = dS^T, B = K, both MN-major,
 *                                over the tile's keys, the head dim split over the warpgroups; or (D 128, 32 query
 *                                rows: wgmma's M is 64) dQ^T = K^T dS^T, A = K^T by 64-column panel of K, B = dS^T,
 *                                both MN-major, the panels split over the warpgroups; added to the fp32 workspace
 *                                atomically (the deterministic mode skips it)
 * dK = scale dK and dV written once at the end (grouped-query heads summed in registers). Tiles:
 * NATIVE_BACKWARD_TILES_WGMMA (native.cuh): at D 128, dK and dV take 128 registers a thread, S^T and dP^T of 32 query
 * rows 32 more (of 64 rows: 64 more, 253 registers in all). Built for sm_90a only (setup.py); the host refuses other GPUs. */
#include "native.cuh"
#include "native_backward_wgmma.cuh"
#include "wgmma.cuh"

/* dS^T takes one 64-column panel of block_kv rows (at block_q 32 half of each 128-byte row is unused) */
template <int D, int BKV, int BQ> constexpr int native_bwd_wgmma_smem() {
    return 16 * BQ + (2 * BKV * D + 4 * BQ * D + BKV * 64) * 2 + 1024;
}

template <typename T, int D, int BKV, int BQ>
__global__ void __launch_bounds__(BKV * 2, 1) native_backward_wgmma_kernel(const native_bwd_args a) {
#if FADEV_WGMMA
    static_assert((D == 64 && BQ == 64) || (D == 128 && (BQ == 32 || BQ == 64)), "D 64: 64 query rows, D 128: 32 or 64");
    constexpr int NT = BKV * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* the swizzle atoms must be 1024-byte aligned (wgmma.cuh); lse and Dvec after the tiles */
    T *sK = reinterpret_cast<T *>(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u)); /* BKV x D */
    T *sV = sK + BKV * D;                                           /* BKV x D */
    T *sQ = sV + BKV * D;                                           /* 2 stages of BQ x D */
    T *sdO = sQ + 2 * BQ * D;                                       /* 2 stages of BQ x D */
    T *sdS = sdO + 2 * BQ * D;                                      /* BKV x 64: dS^T */
    float *sL = reinterpret_cast<float *>(sdS + BKV * 64);          /* 2 stages of BQ: lse */
    float *sDv = sL + 2 * BQ;                                       /* 2 stages of BQ: Dvec */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, g = lane >> 2, t4 = lane & 3;

    const bwd_tile<T, D, BKV, BQ> tile(a);
    const head_rows<const T> K = tile.K, V = tile.V;
    const int k0 = tile.k0, off = tile.off, n_it = tile.n_it;
    auto head_of = [&](int it) { return tile.head_of(a, it); };
    auto first_row = [&](int it) { return tile.first_row(it); };
    auto issue = [&](int it, int st) {
        tile.template issue<NT, true>(a, it, sQ + st * BQ * D, sdO + st * BQ * D, sL + st * BQ, sDv + st * BQ, tid);
    };

    load_rows<T, BKV, D, NT, true>(sK, K, k0, a.seq_kv, tid);
    load_rows<T, BKV, D, NT, true>(sV, V, k0, a.seq_kv, tid);
    if (n_it > 0) issue(0, 0);
    cp_async_commit();

    /* this lane's keys: key0 (fragment half 0) and key0 + 8 (half 1) */
    const int wkey = warp * 16, key0 = k0 + wkey + g;
    const uint32_t aK = smem_u32(sK) + wg * 64 * 128, aV = smem_u32(sV) + wg * 64 * 128; /* this warpgroup's rows */
    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;

    for (int it = 0; it < n_it; ++it) {
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads(); /* tile `it` landed; everyone is done with iteration it - 1 (its stage and sdS) */
        if (it + 1 < n_it) issue(it + 1, (it + 1) & 1);
        cp_async_commit();
        const int st = it & 1, q0 = first_row(it);
        const int64_t bh = head_of(it);
        const T *cQ = sQ + st * BQ * D, *cdO = sdO + st * BQ * D;
        const float *cL = sL + st * BQ, *cDv = sDv + st * BQ;
        const uint32_t aQ = smem_u32(cQ), adO = smem_u32(cdO);

        /* S^T = K Q^T, dP^T = V dO^T */
        float sp[BQ / 2], dp[BQ / 2];
        wgmma_score_pair<T, BQ, D, BKV, BQ>(sp, dp, aK, aQ, aV, adO);
        wgmma_wait_all();
        wgmma_fence_regs(sp);
        wgmma_fence_regs(dp);

        bwd_ds_tile<BQ, BKV>(a, sp, dp, cL, cDv, q0, k0, off, key0, t4); /* P^T, dS^T */
        uint32_t pa[BQ / 16][4], sa[BQ / 16][4];
        wgmma_pack_a<T, BQ>(pa, sp);
        wgmma_pack_a<T, BQ>(sa, dp);
        bwd_issue_dkdv<T, D, BQ>(dk, dv, pa, sa, aQ, adO);

        if (a.dq_acc) { /* else deterministic: dQ by native_dq_pass */
            bwd_store_ds<T, BKV, BQ>(sdS, sa, wkey, g, t4); /* this warpgroup's dS^T to its rows of the tile's */
            fence_proxy_async();
            __syncthreads(); /* every warpgroup's dS^T stored */
            constexpr int NWG = BKV / 64;
            if constexpr (BQ == 64) { /* the head dim split over the warpgroups (native_backward_wgmma.cuh) */
                constexpr int DN = D / NWG;
                float dq[DN / 2];
                bwd_issue_dq<T, DN, BKV>(dq, smem_u32(sdS), smem_u32(sK), wg * DN);
                wgmma_wait_all();
                wgmma_fence_regs(dq);
                bwd_add_dq<D, DN>(a, dq, bh, q0, wg * DN, warp & 3, g, t4);
            } else {
                /* dQ^T[d][q0 .. q0 + BQ] += K^T dS^T for the head dim's 64-column panels pn = wg, wg + NWG, ..:
                 * A = panel pn of K (keys x 64 d), B = dS^T (keys x BQ queries), both MN-major; element (nb, e) of
                 * the accumulators: d = 64 pn + 16 (warp % 4) + g + 8 (e >> 1), query q0 + 8 nb + 2 t4 + (e & 1) */
#pragma unroll
                for (int i = 0; i < D / 64 / NWG; ++i) { /* a trip count known to ptxas: no divergent wgmma */
                    const int pn = wg + i * NWG;
                    float dq[BQ / 2];
                    wgmma_fence();
#pragma unroll
                    for (int kk = 0; kk < BKV / 16; ++kk)
                        wgmma_ss_tt<T, BQ>(dq, wgmma_desc(smem_u32(sK) + pn * BKV * 128 + kk * 2048, BKV * 128, 1024),
                                           wgmma_desc(smem_u32(sdS) + kk * 2048, BKV * 128, 1024), kk > 0);
                    wgmma_commit();
                    wgmma_wait_all();
                    wgmma_fence_regs(dq);
#pragma unroll
                    for (int nb = 0; nb < BQ / 8; ++nb) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int row = q0 + nb * 8 + 2 * t4 + (e & 1), col = pn * 64 + (warp & 3) * 16 + g + 8 * (e >> 1);
                            if (row < a.seq_q) atomicAdd(a.dq_acc + (bh * a.seq_q + row) * D + col, dq[4 * nb + e]);
                        }
                    }
                }
            }
        } else {
            wgmma_wait_all();
        }
        wgmma_fence_regs(dk);
        wgmma_fence_regs(dv);
    }
    cp_async_wait_all(); /* no copy outlives the CTA */

    bwd_store_dkdv<T, D>(a, tile.b, tile.hk, key0, t4, dk, dv);
#else
    __trap(); /* not an sm_90a build: never launched (native_backward_wgmma checks the device) */
#endif
}

template <typename T, int D, int BQ, int BKV>
static fadev_status native_bwd_wgmma_launch(const fadev_native_params *p, const native_bwd_args &a, const void *out) {
    constexpr int smem = native_bwd_wgmma_smem<D, BKV, BQ>();
    FADEV_TRY((native_backward_before<T, D>(p, a, out)));
    bool ran = false;
    FADEV_TRY(native_backward_tma(p, a, &ran));
    if (!ran)
        FADEV_TRY(native_bwd_launch(native_backward_wgmma_kernel<T, D, BKV, BQ>,
                                    p->attn.batch * p->attn.heads_kv * a.n_kt, BKV * 2, smem, a));
    return native_backward_after<T, D>(p, a);
}

template <typename T>
static fadev_status native_bwd_wgmma_dispatch(const fadev_native_params *p, const native_bwd_args &a, const void *out) {
    const int d = (int)p->attn.dim, bq = p->attn.block_q, bkv = p->attn.block_kv;
#define NATIVE_BWD_WGMMA_CASE(dim, q, kv) \
    if (d == dim && bq == q && bkv == kv) return native_bwd_wgmma_launch<T, dim, q, kv>(p, a, out);
    NATIVE_BACKWARD_TILES_WGMMA(NATIVE_BWD_WGMMA_CASE)
#undef NATIVE_BWD_WGMMA_CASE
    return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: wgmma backward tile not compiled");
}

fadev_status native_backward_wgmma(const fadev_native_params *p, const native_bwd_args &a, const void *out) {
    FADEV_TRY(native_require_hopper());
    return p->dtype == FADEV_NATIVE_FP16 ? native_bwd_wgmma_dispatch<__half>(p, a, out)
                                         : native_bwd_wgmma_dispatch<__nv_bfloat16>(p, a, out);
}
