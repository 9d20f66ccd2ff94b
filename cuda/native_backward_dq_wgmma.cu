/* The deterministic backward's dQ pass on Hopper's warpgroup MMA (mma = 1, after the wgmma dK/dV kernel):
 * native_backward_dq.cu's pass, the same arithmetic per element in the same order, its products issued by one
 * warpgroup as wgmma.m64nNk16 (wgmma.cuh) instead of per-warp mma.m16n8k16.
 *
 * One CTA (one warpgroup: warp w owns query rows [16w, 16w + 16), the mma.sync pass's rows) per (batch, head, 64
 * query rows). Q and dO sit in shared memory, the K/V tiles (BKV keys) in two cp.async stages, all in wgmma's
 * 128-byte-swizzled panels; for each K/V tile j in key order
 *   S = Q Kj^T, dP = dO Vj^T    D / 16 wgmma each, A = Q / dO, B = Kj / Vj from shared memory (K-major)
 *   dS = P (dP - Dvec)          dq_tile::ds, on the same fragment layout (wgmma.cuh)
 *   dQ += round(dS) Kj          BKV / 16 wgmma, A = dS from registers, B = Kj MN-major (transposed)
 * then dq = round(scale dQ). The same k16 steps in the same order as the mma.sync pass, so the same bits (tested:
 * tests/test_cuda_native_wgmma.py compares the deterministic dq of both instructions). Built for sm_90a only
 * (setup.py); the wgmma backward's host checks the device. */
#include "native.cuh"
#include "wgmma.cuh"

template <int D, int BKV> constexpr int native_dq_wgmma_smem() { return (2 * 64 + 4 * BKV) * D * 2 + 1024; }

template <typename T, int D, int BKV>
__global__ void __launch_bounds__(128) native_dq_wgmma_kernel(const native_bwd_args a) {
#if FADEV_WGMMA
    constexpr int BQ = 64, NT = 128;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* the swizzle atoms must be 1024-byte aligned (wgmma.cuh) */
    const auto [sQ, sdO, sK, sV] =
        dq_tile<T, D, BQ, BKV>::carve(reinterpret_cast<T *>(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u)));
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;

    const dq_tile<T, D, BQ, BKV> tile(a, warp, g);
    const head_rows<const T> K = tile.K, V = tile.V;
    const int n_kt = tile.n_kt;

    tile.template load_first<NT, true>(a, sQ, sdO, sK, sV, tid);

    const uint32_t aQ = smem_u32(sQ), adO = smem_u32(sdO);
    float dq[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dq[i] = 0.f;

    for (int j = 0; j < n_kt; ++j) {
        cp_async_wait_all();
        fence_proxy_async();
        __syncthreads(); /* tile j landed for everyone; everyone's products of tile j - 1 are done */
        prefetch_kv<T, BKV, D, NT, true>(sK, sV, K, V, j, n_kt, a.seq_kv, tid);
        const uint32_t aK = smem_u32(sK + (j & 1) * BKV * D), aV = smem_u32(sV + (j & 1) * BKV * D);

        float s[BKV / 2], dp[BKV / 2];
        wgmma_score_pair<T, BKV, D, BQ, BKV>(s, dp, aQ, aK, adO, aV);
        wgmma_wait_all();
        wgmma_fence_regs(s);
        wgmma_fence_regs(dp);

        tile.ds_tile(a, s, dp, j, t4); /* dS in place of S */

        /* dQ += round(dS) Kj: A = dS (key chunk kk), B = Kj MN-major: keys kk * 16 .. at byte 2048 kk, the
         * 64-column panels BKV * 128 bytes apart */
        uint32_t da[BKV / 16][4];
        wgmma_pack_a<T, BKV>(da, s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BKV / 16; ++kk) wgmma_rs<T, D, 1>(dq, da[kk], wgmma_desc(aK + kk * 2048, BKV * 128, 1024), 1);
        wgmma_commit();
        wgmma_wait_all();
        wgmma_fence_regs(dq);
    }
    cp_async_wait_all(); /* no copy outlives the CTA */

    tile.store_all(a, dq, t4);
#else
    __trap(); /* not an sm_90a build: never launched (the wgmma backward checks the device) */
#endif
}

template <typename T, int D, int BKV> static fadev_status native_dq_wgmma_launch(const fadev_native_params *p, native_bwd_args a) {
    constexpr int smem = native_dq_wgmma_smem<D, BKV>();
    a.n_qt = (int)((p->attn.seq_q + 63) / 64);
    return native_bwd_launch(native_dq_wgmma_kernel<T, D, BKV>, p->attn.batch * p->attn.heads * a.n_qt, 128, smem, a);
}

fadev_status native_dq_pass_wgmma(const fadev_native_params *p, native_bwd_args a) {
    bool ran = false;
    FADEV_TRY(native_dq_pass_tma(p, a, &ran));
    if (ran) return FADEV_OK;
    return native_dq_dispatch(p, [&](auto t, auto d) { return native_dq_wgmma_launch<decltype(t), d.value, 64>(p, a); });
}
