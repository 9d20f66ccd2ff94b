/* Native FlashAttention-2 backward on the tensor cores: fp16 / bf16 in and out, fp32 accumulation. Three kernels:
 *   1. Dvec_i = rowsum(dO * O)                      fp32, one warp per query row
 *   2. one CTA per (batch, K/V head, block_kv keys); warp w owns keys [16w, 16w + 16) of the tile, with its dK and
 *      dV rows in fp32 registers. It loops over the query heads of its group and the query tiles (block_q_bwd rows,
 *      cp.async, two stages) that see any of its keys:
 *        S^T  = K Q^T                               mma.sync m16n8k16, fp32
 *        P^T  = exp2(S^T * scale log2(e) - lse_i log2(e))   (0 where masked: keys >= Nk, queries >= Nq, causal)
 *        dP^T = V dO^T
 *        dS^T = P^T * (dP^T - Dvec_i)               fp32
 *        dV  += round(P^T) dO,  dK += round(dS^T) Q   (the accumulators, rounded, are the next mma's A operand)
 *        dQ_i += round(dS) K                         through shared memory (dS^T stored, read back with ldmatrix
 *                                                    .trans), fp32 atomicAdd into the workspace
 *      then dK = scale dK and dV are written once (grouped-query heads summed in registers, no atomics);
 *   3. dQ = round(scale * dQ_acc).
 * Deterministic mode: kernel 2 skips dQ, and kernel 3 is native_backward_dq.cu's pass (native_backward_dq_wgmma.cu's
 * after the wgmma kernel 2: the same bits), one CTA per query tile
 * looping over the K/V tiles in key order (S, P, dP, dS recomputed: 7 products per pair instead of 5), dQ in
 * registers: no atomics, so the same bits on every run.
 * Masks and shapes as the forward (native_forward.cu): causal bottom-right aligned, ragged tiles zero-filled;
 * q, out, dout, dq: (B, H, Nq, D); k, v, dk, dv: (B, Hkv, Nk, D); lse (B, H, Nq) natural log as the forward
 * returns it. Tiles: keys by block_kv (block_kv / 16 warps), queries by block_q: NATIVE_BACKWARD_TILES (native.cuh),
 * a list of its own (the registers hold dK and dV besides S^T and dP^T, so block_q is smaller than the forward's).
 * Workspace (float32): dQ_acc (B H Nq D), then Dvec (B H Nq). */
#include "native.cuh"

template <int D, int BKV, int BQ> constexpr int native_bwd_smem() {
    return 16 * BQ + (2 * BKV * D + 4 * BQ * D + BKV * BQ) * 2;
}

/* Dvec[r] for rows r = (b H + h) Nq + i of out and dout (their own strides), a warp per row */
template <typename T, int D>
__global__ void native_dot_kernel(const native_bwd_args a, const void *out_, float *dvec, int64_t rows) {
    const int lane = threadIdx.x & 31;
    const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
    for (int64_t r = blockIdx.x * (int64_t)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        int64_t i;
        const int bh = (int)div_mod(r, a.seq_q, i);
        const T *out = head_of<const T>(out_, a.so, bh, a.heads).row(i), *dout = head_of<const T>(a.dout, a.sdo, bh, a.heads).row(i);
        float acc = 0.f;
#pragma unroll
        for (int e = lane; e < D; e += 32) acc += to_float<T>(out[e]) * to_float<T>(dout[e]);
        acc = warp_sum(acc);
        if (lane == 0) dvec[r] = acc;
    }
}

/* dq = round(scale dQ_acc): the workspace is contiguous (B, H, Nq, D), dq has its own strides */
template <typename T, int D> __global__ void native_dq_kernel(const native_bwd_args a, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t row;
        const int bh = (int)div_mod(i / D, a.seq_q, row);
        head_of<T>(a.dq, a.sdq, bh, a.heads).row(row)[i % D] = from_float<T>(a.dq_acc[i] * a.scale);
    }
}

/* MI = keys per warp / 16: each warp runs MI m16 key blocks side by side, so every Q / dO fragment it reads from
 * shared memory feeds MI mma instructions */
template <typename T, int D, int BKV, int BQ, int MI>
__global__ void __launch_bounds__(BKV * 2 / MI) native_backward_kernel(const native_bwd_args a) {
    constexpr int NT = BKV * 2 / MI, C = D / 8, QC = BQ / 8;
    /* dQ = dS K split over the W warps: MT query blocks of 16 rows; MW warps side by side over them (each takes
     * MT / MW blocks in turn), times NDP column parts of DW columns (at least 16), each done DS <= 64 columns at a
     * time (the accumulators' registers); warps >= MW NDP idle */
    constexpr int W = BKV / 16 / MI, MT = BQ / 16, MW = W < MT ? W : MT, NDP = W / MW < D / 16 ? W / MW : D / 16,
                  DW = D / NDP, DS = DW < 64 ? DW : 64;
    static_assert(MT % MW == 0 && DW % DS == 0 && DS % 16 == 0 && MW * NDP <= W, "dQ split");
    extern __shared__ __align__(16) unsigned char smem[];
    float *sL = reinterpret_cast<float *>(smem); /* 2 stages of BQ: lse */
    float *sDv = sL + 2 * BQ;                     /* 2 stages of BQ: Dvec */
    T *sK = reinterpret_cast<T *>(sDv + 2 * BQ);  /* BKV x D */
    T *sV = sK + BKV * D;                         /* BKV x D */
    T *sQ = sV + BKV * D;                         /* 2 stages of BQ x D */
    T *sdO = sQ + 2 * BQ * D;                     /* 2 stages of BQ x D */
    T *sdS = sdO + 2 * BQ * D;                    /* BKV x BQ: dS^T */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t4 = lane & 3;

    const bwd_tile<T, D, BKV, BQ> tile(a);
    const head_rows<const T> K = tile.K, V = tile.V;
    const int k0 = tile.k0, off = tile.off, n_it = tile.n_it;
    auto head_of = [&](int it) { return tile.head_of(a, it); };
    auto first_row = [&](int it) { return tile.first_row(it); };
    auto issue = [&](int it, int st) {
        tile.template issue<NT, false>(a, it, sQ + st * BQ * D, sdO + st * BQ * D, sL + st * BQ, sDv + st * BQ, tid);
    };

    load_rows<T, BKV, D, NT>(sK, K, k0, a.seq_kv, tid);
    load_rows<T, BKV, D, NT>(sV, V, k0, a.seq_kv, tid);
    if (n_it > 0) issue(0, 0);
    cp_async_commit();

    /* this lane's keys in key block mi: key0 + 16 mi (fragment half 0) and + 8 (half 1) */
    const int wkey = warp * 16 * MI, key0 = k0 + wkey + g;
    float dk[MI][D / 8][4], dv[MI][D / 8][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            dk[mi][i][0] = dk[mi][i][1] = dk[mi][i][2] = dk[mi][i][3] = 0.f;
            dv[mi][i][0] = dv[mi][i][1] = dv[mi][i][2] = dv[mi][i][3] = 0.f;
        }

    for (int it = 0; it < n_it; ++it) {
        cp_async_wait_all();
        __syncthreads(); /* tile `it` landed; everyone is done with iteration it - 1 (its stage and sdS) */
        if (it + 1 < n_it) issue(it + 1, (it + 1) & 1);
        cp_async_commit();
        const int st = it & 1, q0 = first_row(it);
        const int64_t bh = head_of(it);
        const T *cQ = sQ + st * BQ * D, *cdO = sdO + st * BQ * D;
        const float *cL = sL + st * BQ, *cDv = sDv + st * BQ;

        /* S^T = K Q^T and dP^T = V dO^T: A = this warp's K / V rows, B[k = d][n = query] = Q[query][d] */
        float sp[MI][BQ / 8][4], dp[MI][BQ / 8][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int i = 0; i < BQ / 8; ++i) {
                sp[mi][i][0] = sp[mi][i][1] = sp[mi][i][2] = sp[mi][i][3] = 0.f;
                dp[mi][i][0] = dp[mi][i][1] = dp[mi][i][2] = dp[mi][i][3] = 0.f;
            }
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t ka[MI][4], va[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                ldmatrix_x4(ka[mi], sK + swz<C>(wkey + 16 * mi + (lane & 15), kk * 2 + (lane >> 4)));
                ldmatrix_x4(va[mi], sV + swz<C>(wkey + 16 * mi + (lane & 15), kk * 2 + (lane >> 4)));
            }
#pragma unroll
            for (int np = 0; np < BQ / 16; ++np) {
                const int row = np * 16 + (lane & 7) + ((lane >> 4) << 3), ch = kk * 2 + ((lane >> 3) & 1);
                uint32_t bq[4], bo[4];
                ldmatrix_x4(bq, cQ + swz<C>(row, ch));
                ldmatrix_x4(bo, cdO + swz<C>(row, ch));
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    mma_16816<T>(sp[mi][2 * np], ka[mi], bq[0], bq[1]);
                    mma_16816<T>(sp[mi][2 * np + 1], ka[mi], bq[2], bq[3]);
                    mma_16816<T>(dp[mi][2 * np], va[mi], bo[0], bo[1]);
                    mma_16816<T>(dp[mi][2 * np + 1], va[mi], bo[2], bo[3]);
                }
            }
        }

        /* P^T, then dS^T = P^T (dP^T - Dvec) in place of dP^T; element (nb, e): key key0 + 8 (e >> 1), query
         * q0 + 8 nb + 2 t4 + (e & 1) */
        const bool masked = q0 + BQ > a.seq_q || k0 + BKV > a.seq_kv || (a.causal && k0 + BKV - 1 > q0 + off);
        with_mask(masked, [&](auto mask) {
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int nb = 0; nb < BQ / 8; ++nb) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = nb * 8 + 2 * t4 + (e & 1), key = key0 + 16 * mi + 8 * (e >> 1);
                        float p = fast_exp2(sp[mi][nb][e] * a.scale_log2 - cL[i] * (float)NATIVE_LOG2E);
                        if (mask.value && (q0 + i >= a.seq_q || key >= a.seq_kv || (a.causal && key > q0 + i + off)))
                            p = 0.f;
                        sp[mi][nb][e] = p;
                        dp[mi][nb][e] = p * (dp[mi][nb][e] - cDv[i]);
                    }
                }
        });

        /* dV += round(P^T) dO, dK += round(dS^T) Q: A from the accumulators (query chunk kk = blocks 2kk, 2kk+1),
         * B[k = query][n = d] = dO[query][d], rows as stored, so ldmatrix .trans */
#pragma unroll
        for (int kk = 0; kk < BQ / 16; ++kk) {
            uint32_t pa[MI][4], sa[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                pa[mi][0] = pack2<T>(sp[mi][2 * kk][0], sp[mi][2 * kk][1]);
                pa[mi][1] = pack2<T>(sp[mi][2 * kk][2], sp[mi][2 * kk][3]);
                pa[mi][2] = pack2<T>(sp[mi][2 * kk + 1][0], sp[mi][2 * kk + 1][1]);
                pa[mi][3] = pack2<T>(sp[mi][2 * kk + 1][2], sp[mi][2 * kk + 1][3]);
                sa[mi][0] = pack2<T>(dp[mi][2 * kk][0], dp[mi][2 * kk][1]);
                sa[mi][1] = pack2<T>(dp[mi][2 * kk][2], dp[mi][2 * kk][3]);
                sa[mi][2] = pack2<T>(dp[mi][2 * kk + 1][0], dp[mi][2 * kk + 1][1]);
                sa[mi][3] = pack2<T>(dp[mi][2 * kk + 1][2], dp[mi][2 * kk + 1][3]);
            }
#pragma unroll
            for (int dd = 0; dd < D / 16; ++dd) {
                const int row = kk * 16 + (lane & 7) + (lane & 8), ch = dd * 2 + (lane >> 4);
                uint32_t bo[4], bq[4];
                ldmatrix_x4_trans(bo, cdO + swz<C>(row, ch));
                ldmatrix_x4_trans(bq, cQ + swz<C>(row, ch));
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    mma_16816<T>(dv[mi][2 * dd], pa[mi], bo[0], bo[1]);
                    mma_16816<T>(dv[mi][2 * dd + 1], pa[mi], bo[2], bo[3]);
                    mma_16816<T>(dk[mi][2 * dd], sa[mi], bq[0], bq[1]);
                    mma_16816<T>(dk[mi][2 * dd + 1], sa[mi], bq[2], bq[3]);
                }
            }
        }

        if (!a.dq_acc) continue; /* deterministic: dQ by native_dq_pass */
        /* dS^T (rows: keys, cols: queries) to shared memory for dQ */
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int nb = 0; nb < BQ / 8; ++nb) {
                const int r0 = wkey + 16 * mi + g;
                *reinterpret_cast<uint32_t *>(sdS + swz<QC>(r0, nb) + 2 * t4) = pack2<T>(dp[mi][nb][0], dp[mi][nb][1]);
                *reinterpret_cast<uint32_t *>(sdS + swz<QC>(r0 + 8, nb) + 2 * t4) = pack2<T>(dp[mi][nb][2], dp[mi][nb][3]);
            }
        __syncthreads();

        /* dQ[q0 + 16 mt .. + 16][DW dpart .. + DW] += dS K over the tile's keys: A[query][key] = dS^T[key][query]
         * (ldmatrix .trans of dS^T), B[k = key][n = d] = K[key][d] (.trans) */
        if (warp >= MW * NDP) continue;
        const int dpart = warp / MW;
        float *dQ = a.dq_acc + bh * a.seq_q * D;
#pragma unroll
        for (int mi = 0; mi < MT / MW; ++mi) {
#pragma unroll
            for (int sub = 0; sub < DW / DS; ++sub) {
                const int mt = warp % MW + MW * mi, col0 = dpart * DW + sub * DS;
                float dq[DS / 8][4];
#pragma unroll
                for (int i = 0; i < DS / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < BKV / 16; ++kk) {
                    uint32_t da[4];
                    ldmatrix_x4_trans(da, sdS + swz<QC>(kk * 16 + (lane & 7) + ((lane >> 4) << 3), mt * 2 + ((lane >> 3) & 1)));
#pragma unroll
                    for (int dd = 0; dd < DS / 16; ++dd) {
                        uint32_t bk[4];
                        ldmatrix_x4_trans(bk, sK + swz<C>(kk * 16 + (lane & 7) + (lane & 8), col0 / 8 + dd * 2 + (lane >> 4)));
                        mma_16816<T>(dq[2 * dd], da, bk[0], bk[1]);
                        mma_16816<T>(dq[2 * dd + 1], da, bk[2], bk[3]);
                    }
                }
#pragma unroll
                for (int nb = 0; nb < DS / 8; ++nb) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int row = q0 + mt * 16 + g + 8 * (e >> 1), col = col0 + nb * 8 + 2 * t4 + (e & 1);
                        if (row < a.seq_q) atomicAdd(dQ + (int64_t)row * D + col, dq[nb][e]);
                    }
                }
            }
        }
    }
    cp_async_wait_all(); /* no copy outlives the CTA (n_it >= 1 anyway: the last query row sees every key) */

    const head_rows<T> dK = head_at<T>(a.dk, a.sdk, tile.b, tile.hk), dV = head_at<T>(a.dv, a.sdv, tile.b, tile.hk);
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int db = 0; db < D / 8; ++db) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int key = key0 + 16 * mi + 8 * r;
            if (key < a.seq_kv) {
                const int col = db * 8 + 2 * t4;
                *reinterpret_cast<uint32_t *>(dK.row(key) + col) = pack2<T>(dk[mi][db][2 * r] * a.scale, dk[mi][db][2 * r + 1] * a.scale);
                *reinterpret_cast<uint32_t *>(dV.row(key) + col) = pack2<T>(dv[mi][db][2 * r], dv[mi][db][2 * r + 1]);
            }
        }
    }
}

/* ---------------------------------------------------------------- host entry points */

static unsigned native_blocks(int64_t work, int per_block) {
    const int64_t b = (work + per_block - 1) / per_block;
    return (unsigned)(b < 1 ? 1 : b > (1 << 20) ? (1 << 20) : b);
}

/* Before the dK/dV kernel (both instructions' backward): dQ_acc zeroed (atomic mode), Dvec = rowsum(dO * O). */
template <typename T, int D>
fadev_status native_backward_before(const fadev_native_params *p, const native_bwd_args &a, const void *out) {
    const int64_t rows = p->attn.batch * p->attn.heads * p->attn.seq_q, n = rows * D;
    if (a.dq_acc) CUDA_TRY(cudaMemsetAsync(a.dq_acc, 0, (size_t)n * sizeof(float), a.stream));
    native_dot_kernel<T, D><<<native_blocks(rows, 8), 256, 0, a.stream>>>(a, out, const_cast<float *>(a.dvec), rows);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

/* After it: dQ = round(scale * dQ_acc), or the deterministic dQ pass. */
template <typename T, int D> fadev_status native_backward_after(const fadev_native_params *p, const native_bwd_args &a) {
    if (!a.dq_acc) return p->mma ? native_dq_pass_wgmma(p, a) : native_dq_pass(p, a);
    const int64_t n = p->attn.batch * p->attn.heads * p->attn.seq_q * D;
    native_dq_kernel<T, D><<<native_blocks(n, 256), 256, 0, a.stream>>>(a, n);
    CUDA_TRY(cudaGetLastError());
    return FADEV_OK;
}

#define NATIVE_BACKWARD_STEPS(T, D)                                                                                     \
    template fadev_status native_backward_before<T, D>(const fadev_native_params *, const native_bwd_args &, const void *); \
    template fadev_status native_backward_after<T, D>(const fadev_native_params *, const native_bwd_args &);
NATIVE_BACKWARD_STEPS(__half, 64)
NATIVE_BACKWARD_STEPS(__half, 128)
NATIVE_BACKWARD_STEPS(__nv_bfloat16, 64)
NATIVE_BACKWARD_STEPS(__nv_bfloat16, 128)
#undef NATIVE_BACKWARD_STEPS

template <typename T, int D, int BQ, int BKV, int MI>
static fadev_status native_backward_launch(const fadev_native_params *p, const native_bwd_args &a, const void *out) {
    constexpr int smem = native_bwd_smem<D, BKV, BQ>();
    FADEV_TRY((native_backward_before<T, D>(p, a, out)));
    FADEV_TRY(native_bwd_launch(native_backward_kernel<T, D, BKV, BQ, MI>, p->attn.batch * p->attn.heads_kv * a.n_kt,
                                BKV * 2 / MI, smem, a));
    return native_backward_after<T, D>(p, a);
}

template <typename T>
static fadev_status native_backward_dispatch(const fadev_native_params *p, native_bwd_args a, const void *out) {
    const int bq = p->attn.block_q, bkv = p->attn.block_kv, wide = p->warp_rows == 32;
    a.n_kt = (int)((p->attn.seq_kv + bkv - 1) / bkv);
    if (p->mma) return native_backward_wgmma(p, a, out);
#define NATIVE_BACKWARD_CASE(d, q, kv) \
    if (!wide && p->attn.dim == d && bq == q && bkv == kv) return native_backward_launch<T, d, q, kv, 1>(p, a, out);
    NATIVE_BACKWARD_TILES(NATIVE_BACKWARD_CASE)
#undef NATIVE_BACKWARD_CASE
#define NATIVE_BACKWARD_CASE(d, q, kv) \
    if (wide && p->attn.dim == d && bq == q && bkv == kv) return native_backward_launch<T, d, q, kv, 2>(p, a, out);
    NATIVE_BACKWARD_TILES_32(NATIVE_BACKWARD_CASE)
#undef NATIVE_BACKWARD_CASE
    return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: tile not compiled");
}

extern "C" size_t fadev_cuda_native_workspace(const fadev_native_params *params) {
    if (native_validate(params, 1) != FADEV_OK) return 0;
    const size_t rows = (size_t)params->attn.batch * (size_t)params->attn.heads * (size_t)params->attn.seq_q;
    return (rows * (size_t)params->attn.dim + rows) * sizeof(float);
}

extern "C" fadev_status fadev_cuda_native_backward(const void *q, const void *k, const void *v, const void *out,
                                                   const float *lse, const void *dout, void *dq, void *dk, void *dv,
                                                   float *workspace, const fadev_native_params *params) {
    FADEV_TRY(fadev_cuda_require_device());
    FADEV_TRY(native_validate(params, 1));
    if (!q || !k || !v || !out || !lse || !dout || !dq || !dk || !dv || !workspace)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT,
                          "fadev_cuda_native_backward: a NULL q, k, v, out, lse, dout, dq, dk, dv or workspace");
    if (!native_aligned(q, 16) || !native_aligned(k, 16) || !native_aligned(v, 16) || !native_aligned(out, 16) ||
        !native_aligned(dout, 16) || !native_aligned(dq, 16) || !native_aligned(dk, 16) || !native_aligned(dv, 16) ||
        !native_aligned(lse, 4) || !native_aligned(workspace, 16))
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_native_backward: q, k, v, out, dout, dq, dk, dv and "
                                                      "workspace must be 16-byte aligned and lse 4-byte aligned");
    const size_t rows = (size_t)params->attn.batch * (size_t)params->attn.heads * (size_t)params->attn.seq_q;
    native_bwd_args a;
    a.q = q, a.k = k, a.v = v, a.dout = dout, a.lse = lse;
    a.dq_acc = params->deterministic ? NULL : workspace, a.dvec = workspace + rows * (size_t)params->attn.dim;
    a.dq = dq, a.dk = dk, a.dv = dv;
    a.heads = (int)params->attn.heads, a.group = (int)(params->attn.heads / params->attn.heads_kv);
    a.seq_q = (int)params->attn.seq_q, a.seq_kv = (int)params->attn.seq_kv, a.causal = params->attn.causal;
    a.n_kt = a.n_qt = 0;
    a.scale_log2 = (float)(params->attn.scale * NATIVE_LOG2E);
    a.scale = (float)params->attn.scale;
    a.sq = native_layout(params, FADEV_NATIVE_Q), a.sk = native_layout(params, FADEV_NATIVE_K);
    a.sv = native_layout(params, FADEV_NATIVE_V), a.so = native_layout(params, FADEV_NATIVE_OUT);
    a.sdo = native_layout(params, FADEV_NATIVE_DOUT), a.sdq = native_layout(params, FADEV_NATIVE_DQ);
    a.sdk = native_layout(params, FADEV_NATIVE_DK), a.sdv = native_layout(params, FADEV_NATIVE_DV);
    a.stream = params->asynchronous ? (cudaStream_t)params->stream : (cudaStream_t)0;
    FADEV_TRY(params->dtype == FADEV_NATIVE_FP16 ? native_backward_dispatch<__half>(params, a, out)
                                                 : native_backward_dispatch<__nv_bfloat16>(params, a, out));
    return native_finish(params, "fadev_cuda_native_backward");
}
