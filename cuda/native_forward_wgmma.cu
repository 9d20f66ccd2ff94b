/* The native forward on Hopper's warpgroup MMA (mma = 1, "wgmma"): FlashAttention-2's algorithm and arithmetic
 * (native_forward.cuh: scores scaled by scale * log2(e) after the product, online softmax with exp2 in fp32, P rounded
 * to fp16 / bf16 as the A operand of P V, fp32 O, deferred normalisation), its products issued by warpgroups of 4
 * warps as wgmma.m64nNk16 (wgmma.cuh) instead of per-warp mma.m16n8k16.
 *
 * One CTA per (batch, head, block_q query rows), block_q / 64 warpgroups; warpgroup w owns query rows [64 w, 64 w +
 * 64) of the tile. Q, and three stages of K and V (cp.async: tile j + 2 loads while tiles j, j + 1 are used), sit in
 * shared memory in wgmma's 128-byte-swizzled layout; for each K/V tile j
 *   S = Q Kj^T          D / 16 wgmma, A = Q and B = Kj from shared memory (K-major), fp32 accumulators in registers
 *   softmax             as the mma.sync kernel, on the same fragment layout (wgmma.cuh)
 *   O += round(P) Vj    block_kv / 16 wgmma, A = P from registers, B = Vj from shared memory (MN-major)
 * Within a warpgroup the products of tile j + 1's scores are issued before P_j V_j, and the softmax of tile j + 1
 * runs while P_j V_j is on the tensor cores (FlashAttention-3's intra-warpgroup overlap, without its producer warps:
 * every thread issues the cp.async loads). The warpgroups of a CTA, and the CTAs of an SM,
 * interleave on their own.
 * Accumulation order: the same k16 steps in the same order as the mma.sync kernel, and the same fp32 operations on
 * each score, so the same bits as the mma.sync kernel wherever both have the tile (measured on an H100 for every
 * shared tile, and tested: tests/test_cuda_native_wgmma.py).
 * Built for sm_90a only (setup.py); the host refuses other GPUs. */
#include "native_forward_wgmma.cuh"

template <int D, int BQ, int BKV> constexpr int native_wgmma_smem() { return (BQ + 6 * BKV) * D * 2 + 1024; }

template <typename T, int D, int BQ, int BKV>
__global__ void __launch_bounds__(BQ * 2, 1) native_forward_wgmma_kernel(const native_fwd_args a) {
#if FADEV_WGMMA
    constexpr int NT = BQ * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    /* the swizzle atoms must be 1024-byte aligned (wgmma.cuh) */
    T *sQ = reinterpret_cast<T *>(smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u));
    T *sK = sQ + BQ * D;      /* 3 stages of BKV x D: tile j in stage j % 3 */
    T *sV = sK + 3 * BKV * D; /* 3 stages of BKV x D */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2, g = lane >> 2, t4 = lane & 3;
    const int wrow = warp * 16; /* this warp's rows of the accumulators: 64 wg + 16 (warp % 4) */

    const fwd_tile<T, D, BQ, BKV> tile(a);
    const head_rows<const T> Q = tile.Q, K = tile.K, V = tile.V;
    const head_rows<T> O = tile.O;
    float *L = tile.L;
    const int q0 = tile.q0, off = tile.off, n_kt = tile.n_kt;
    if (n_kt == 0) return tile.template write_empty<NT>(a, tid);

    /* tiles 0 and 1 in flight, one copy group each */
    load_rows<T, BQ, D, NT, true>(sQ, Q, q0, a.seq_q, tid);
    load_rows<T, BKV, D, NT, true>(sK, K, 0, a.seq_kv, tid);
    load_rows<T, BKV, D, NT, true>(sV, V, 0, a.seq_kv, tid);
    cp_async_commit();
    if (n_kt > 1) {
        load_rows<T, BKV, D, NT, true>(sK + BKV * D, K, BKV, a.seq_kv, tid);
        load_rows<T, BKV, D, NT, true>(sV + BKV * D, V, BKV, a.seq_kv, tid);
    }
    cp_async_commit();

    const row_limits<BKV> rl(a, q0, off, wrow, g);

    float o[D / 2], s[BKV / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2], sum[2];
    uint32_t pa[BKV / 16][4];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    const uint32_t aQ = smem_u32(sQ) + wg * 64 * 128; /* this warpgroup's 64 rows of each Q panel */

    /* tile 0's scores and P */
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
    fence_proxy_async(); /* this thread's cp.async writes, before the tensor cores read them */
    __syncthreads();
    uint32_t qf[wgmma_qreg<D, BQ> ? D / 16 : 1][4];
    if constexpr (wgmma_qreg<D, BQ>) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], sQ + wswz<BQ>(wrow + (lane & 15), kk * 2 + (lane >> 4)));
    }
    issue_scores<T, D, BQ, BKV>(s, qf, aQ, smem_u32(sK));
    wgmma_wait_all();
    wgmma_fence_regs(s);
    tile_softmax<BKV>(s, m, alpha, sum, a.scale_log2, rl.masked(0), 0, t4, rl.lim);
    l[0] = sum[0], l[1] = sum[1];
    wgmma_pack_a<T, BKV>(pa, s);

    /* tile j: the scores of tile j + 1 are issued before P_j V_j, so P_j V_j runs on the tensor cores while the
     * softmax of tile j + 1 runs on the other units; O is rescaled once P_j V_j is done. The last tile's P V is
     * peeled off the loop: with a branch around the score products inside it, ptxas cannot prove the scores' group
     * done at the wait for it and serialises every wgmma (warning C7514). */
    for (int j = 0; j + 1 < n_kt; ++j) {
        cp_async_wait_all(); /* tile j + 1 */
        fence_proxy_async();
        __syncthreads(); /* tile j + 1 landed for everyone; everyone is done with tile j - 1 (stage (j + 2) % 3) */
        if (j + 2 < n_kt) {
            const int st = (j + 2) % 3;
            load_rows<T, BKV, D, NT, true>(sK + st * BKV * D, K, (j + 2) * BKV, a.seq_kv, tid);
            load_rows<T, BKV, D, NT, true>(sV + st * BKV * D, V, (j + 2) * BKV, a.seq_kv, tid);
        }
        cp_async_commit();
        issue_scores<T, D, BQ, BKV>(s, qf, aQ, smem_u32(sK + (j + 1) % 3 * BKV * D));
        issue_pv<T, D, BKV>(o, pa, smem_u32(sV + j % 3 * BKV * D));
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); /* the scores; P_j V_j may run on */
        wgmma_fence_regs(s);
        tile_softmax<BKV>(s, m, alpha, sum, a.scale_log2, rl.masked(j + 1), (j + 1) * BKV, t4, rl.lim);
        wgmma_wait_all();
        wgmma_fence_regs(o);
        rescale_o<D>(o, l, alpha, sum);
        wgmma_pack_a<T, BKV>(pa, s);
    }
    issue_pv<T, D, BKV>(o, pa, smem_u32(sV + (n_kt - 1) % 3 * BKV * D));
    wgmma_wait_all();
    wgmma_fence_regs(o);

    /* every product of this warpgroup is done before its Q rows are overwritten: stage this warp's output rows in its
     * own rows of the Q tile, then store whole 16-byte chunks */
    asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory");
    store_out<T, D, BQ>(o, m, l, sQ, O, L, q0, wrow, lane, a.seq_q);
#else
    __trap(); /* not an sm_90a build: never launched (native_forward_wgmma checks the device) */
#endif
}

template <typename T, int D, int BQ, int BKV>
static fadev_status native_wgmma_launch(const native_fwd_args &a, int64_t ctas) {
    constexpr int smem = native_wgmma_smem<D, BQ, BKV>();
    FADEV_TRY(fadev_cuda_smem_attr((const void *)native_forward_wgmma_kernel<T, D, BQ, BKV>, (int)smem));
    native_forward_wgmma_kernel<T, D, BQ, BKV><<<(unsigned)ctas, BQ * 2, smem, a.stream>>>(a);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

template <typename T> static fadev_status native_wgmma_dispatch(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas) {
    bool ran = false;
    FADEV_TRY(native_forward_tma(p, a, ctas, &ran));
    if (ran) return FADEV_OK;
    const int d = (int)p->attn.dim, bq = p->attn.block_q, bkv = p->attn.block_kv;
#define NATIVE_WGMMA_CASE(dim, q, kv) \
    if (d == dim && bq == q && bkv == kv) return native_wgmma_launch<T, dim, q, kv>(a, ctas);
    NATIVE_FORWARD_TILES_WGMMA(NATIVE_WGMMA_CASE)
#undef NATIVE_WGMMA_CASE
    return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: wgmma tile not compiled");
}

fadev_status native_forward_wgmma(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas) {
    FADEV_TRY(native_require_hopper());
    return p->dtype == FADEV_NATIVE_FP16 ? native_wgmma_dispatch<__half>(p, a, ctas)
                                         : native_wgmma_dispatch<__nv_bfloat16>(p, a, ctas);
}
