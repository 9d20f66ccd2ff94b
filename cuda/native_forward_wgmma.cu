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
#include "native_forward.cuh"
#include "wgmma.cuh"

template <int D, int BQ, int BKV> constexpr int native_wgmma_smem() { return (BQ + 6 * BKV) * D * 2 + 1024; }

/* Q's A operand in registers (loaded once, D / 4 registers a thread; the scores' products then read only Kj from
 * shared memory) or read by descriptor from shared memory for every tile. Default (FADEV_WGMMA_QREG 1): registers at
 * D 64 with up to 2 warpgroups, where the m64nNk16 products of a 64-wide head are short and shared-memory bandwidth
 * is the tighter limit; shared memory at D 128, whose registers hold O, and with 3 warpgroups (168 registers a
 * thread: ptxas serialises the wgmma, warning C7512). FADEV_WGMMA_QREG (setup.py's FADEV_NVCC_FLAGS) 0: never, 2:
 * wherever D 64 -- the same bits either way, for timing the choice. */
#ifndef FADEV_WGMMA_QREG
#define FADEV_WGMMA_QREG 1
#endif
template <int D, int BQ>
constexpr bool wgmma_qreg = D == 64 && (FADEV_WGMMA_QREG == 2 || (FADEV_WGMMA_QREG == 1 && BQ <= 128));

/* The products of one K/V tile, issued by this warpgroup and committed as one wgmma group (not waited for).
 * S = Q Kj^T: A = this warpgroup's 64 Q rows (registers qf, or by descriptor), B = Kj, both K-major; k16 slice kk in
 * panel kk / 4 at byte 32 (kk % 4). */
template <typename T, int D, int BQ, int BKV, int QN>
__device__ __forceinline__ void issue_scores(float (&s)[BKV / 2], const uint32_t (&qf)[QN][4], uint32_t aQ, uint32_t aK) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint64_t dk = wgmma_kslice(aK, BKV, kk);
        if constexpr (wgmma_qreg<D, BQ>)
            wgmma_rs<T, BKV, 0>(s, qf[kk], dk, kk > 0);
        else
            wgmma_ss<T, BKV>(s, wgmma_kslice(aQ, BQ, kk), dk, kk > 0);
    }
    wgmma_commit();
}
/* O += round(P) Vj: A = P from registers (key chunk kk), B = Vj MN-major: keys kk*16.. at byte 2048 kk, the 64-column
 * panels BKV * 128 bytes apart. */
template <typename T, int D, int BKV>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&pa)[BKV / 16][4], uint32_t aV) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BKV / 16; ++kk) wgmma_rs<T, D, 1>(o, pa[kk], wgmma_desc(aV + kk * 2048, BKV * 128, 1024), 1);
    wgmma_commit();
}

/* The softmax of one score tile, in place: scale, mask (keys past lim[r] of rows g, g + 8), new row maxima m, P =
 * exp2(S - m) in s; alpha = exp2(m_old - m) and the rows' partial sums of P for the caller to apply to O and l once
 * the previous tile's P V is done. The same operations in the same order as native_forward.cuh's kernel. */
template <int BKV>
__device__ __forceinline__ void tile_softmax(float (&s)[BKV / 2], float (&m)[2], float (&alpha)[2], float (&sum)[2],
                                             float scale_log2, bool masked, int kv0, int t4, const int (&lim)[2]) {
    with_mask(masked, [&](auto mask) {
#pragma unroll
        for (int nb = 0; nb < BKV / 8; ++nb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[4 * nb + e] *= scale_log2;
                if (mask.value && kv0 + nb * 8 + 2 * t4 + (e & 1) > lim[e >> 1]) s[4 * nb + e] = -INFINITY;
            }
    });
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = m[r];
#pragma unroll
        for (int nb = 0; nb < BKV / 8; ++nb) mx = fmaxf(mx, fmaxf(s[4 * nb + 2 * r], s[4 * nb + 2 * r + 1]));
        mx = quad_max(mx);
        const float ref = mx == -INFINITY ? 0.f : mx; /* all keys so far masked: P = 0, O and l stay 0 */
        alpha[r] = fast_exp2(m[r] - ref);
        m[r] = mx;
        sum[r] = 0.f;
#pragma unroll
        for (int nb = 0; nb < BKV / 8; ++nb) {
            s[4 * nb + 2 * r] = fast_exp2(s[4 * nb + 2 * r] - ref);
            s[4 * nb + 2 * r + 1] = fast_exp2(s[4 * nb + 2 * r + 1] - ref);
            sum[r] += s[4 * nb + 2 * r] + s[4 * nb + 2 * r + 1];
        }
    }
}

template <typename T, int D, int BQ, int BKV>
__global__ void __launch_bounds__(BQ * 2, 1) native_forward_wgmma_kernel(const native_fwd_args a) {
#if FADEV_WGMMA
    constexpr int NT = BQ * 2, C = D / 8;
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

    int lim[2]; /* the last key rows g and g + 8 of this warp may see */
    lim[0] = lim[1] = a.seq_kv - 1;
    if (a.causal) lim[0] = min(lim[0], q0 + wrow + g + off), lim[1] = min(lim[1], q0 + wrow + g + 8 + off);
    /* tile j needs masks: ragged end, or keys past the tile's first row's diagonal */
    auto masked = [&](int j) { return (j + 1) * BKV > a.seq_kv || (a.causal && (j + 1) * BKV - 1 > q0 + off); };

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
    tile_softmax<BKV>(s, m, alpha, sum, a.scale_log2, masked(0), 0, t4, lim);
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
        tile_softmax<BKV>(s, m, alpha, sum, a.scale_log2, masked(j + 1), (j + 1) * BKV, t4, lim);
        wgmma_wait_all();
        wgmma_fence_regs(o);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[r] = l[r] * alpha[r] + sum[r];
#pragma unroll
            for (int db = 0; db < D / 8; ++db) o[4 * db + 2 * r] *= alpha[r], o[4 * db + 2 * r + 1] *= alpha[r];
        }
        wgmma_pack_a<T, BKV>(pa, s);
    }
    issue_pv<T, D, BKV>(o, pa, smem_u32(sV + (n_kt - 1) % 3 * BKV * D));
    wgmma_wait_all();
    wgmma_fence_regs(o);

    /* every product of this warpgroup is done before its Q rows are overwritten: stage this warp's output rows in its
     * own rows of the Q tile, then store whole 16-byte chunks */
    asm volatile("bar.sync %0, 128;\n" ::"r"(wg + 1) : "memory");
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = q0 + wrow + g + 8 * r;
        l[r] = quad_sum(l[r]);
        inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
        if (t4 == 0 && row < a.seq_q) L[row] = l[r] > 0.f ? m[r] * NATIVE_LN2 + logf(l[r]) : -INFINITY;
    }
#pragma unroll
    for (int db = 0; db < D / 8; ++db) {
        *reinterpret_cast<uint32_t *>(sQ + wswz<BQ>(wrow + g, db) + 2 * t4) = pack2<T>(o[4 * db] * inv[0], o[4 * db + 1] * inv[0]);
        *reinterpret_cast<uint32_t *>(sQ + wswz<BQ>(wrow + g + 8, db) + 2 * t4) =
            pack2<T>(o[4 * db + 2] * inv[1], o[4 * db + 3] * inv[1]);
    }
    __syncwarp();
#pragma unroll
    for (int c = lane; c < 16 * C; c += 32) {
        const int r = c / C, row = q0 + wrow + r;
        if (row < a.seq_q)
            *reinterpret_cast<uint4 *>(O.row(row) + c % C * 8) = *reinterpret_cast<const uint4 *>(sQ + wswz<BQ>(wrow + r, c % C));
    }
#else
    __trap(); /* not an sm_90a build: never launched (native_forward_wgmma checks the device) */
#endif
}

template <typename T, int D, int BQ, int BKV>
static fadev_status native_wgmma_launch(const native_fwd_args &a, int64_t ctas) {
    constexpr int smem = native_wgmma_smem<D, BQ, BKV>();
    CUDA_TRY(cudaFuncSetAttribute(native_forward_wgmma_kernel<T, D, BQ, BKV>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    native_forward_wgmma_kernel<T, D, BQ, BKV><<<(unsigned)ctas, BQ * 2, smem, a.stream>>>(a);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

template <typename T> static fadev_status native_wgmma_dispatch(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas) {
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
