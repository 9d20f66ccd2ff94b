/* Host entry points of the native FlashAttention-2 forward (the kernel and its math: native_forward.cuh), with the
 * head dim 64 instances; native_forward_128.cu holds head dim 128's. */
#include "native_forward.cuh"

template <typename T> static fadev_status native_forward_dispatch(const fadev_native_params *p, native_fwd_args a) {
    a.n_qt = (int)((p->attn.seq_q + p->attn.block_q - 1) / p->attn.block_q);
    const int64_t ctas = p->attn.batch * p->attn.heads * a.n_qt;
    if (p->mma) return native_forward_wgmma(p, a, ctas);
    return p->attn.dim == 64 ? native_forward_dim<T, 64>(p, a, ctas) : native_forward_d128(p, a, ctas);
}

extern "C" fadev_status fadev_cuda_native_tiles(int dim, int backward, int warp_rows, int mma, int32_t *tiles,
                                                int max_pairs, int *count) {
    if (!count || max_pairs < 0 || (max_pairs > 0 && !tiles))
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_native_tiles: NULL count or tiles, or max_pairs < 0");
    if (warp_rows != 16 && warp_rows != 32)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_native_tiles: warp_rows must be 16 or 32");
    if (mma != 0 && mma != 1)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_native_tiles: mma must be 0 or 1");
    *count = native_tile_pairs(dim, backward != 0, warp_rows, mma, tiles, max_pairs);
    if (*count == 0) return native_bad(FADEV_ERR_INVALID_ARGUMENT, "native attention: dim must be 64 or 128");
    return FADEV_OK;
}

extern "C" fadev_status fadev_cuda_native_forward(const void *q, const void *k, const void *v, void *out, float *lse,
                                                  const fadev_native_params *params) {
    FADEV_TRY(fadev_cuda_require_device());
    FADEV_TRY(native_validate(params, 0));
    if (!q || !k || !v || !out || !lse)
        return native_bad(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_native_forward: a NULL q, k, v, out or lse");
    if (!native_aligned(q, 16) || !native_aligned(k, 16) || !native_aligned(v, 16) || !native_aligned(out, 16) ||
        !native_aligned(lse, 4))
        return native_bad(FADEV_ERR_INVALID_ARGUMENT,
                          "fadev_cuda_native_forward: q, k, v, out must be 16-byte aligned and lse 4-byte aligned");
    native_fwd_args a;
    a.q = q, a.k = k, a.v = v, a.out = out, a.lse = lse;
    a.heads = (int)params->attn.heads, a.group = (int)(params->attn.heads / params->attn.heads_kv);
    a.seq_q = (int)params->attn.seq_q, a.seq_kv = (int)params->attn.seq_kv, a.causal = params->attn.causal;
    a.n_qt = 0;
    a.scale_log2 = (float)(params->attn.scale * NATIVE_LOG2E);
    a.sq = native_layout(params, FADEV_NATIVE_Q), a.sk = native_layout(params, FADEV_NATIVE_K);
    a.sv = native_layout(params, FADEV_NATIVE_V), a.so = native_layout(params, FADEV_NATIVE_OUT);
    a.stream = params->asynchronous ? (cudaStream_t)params->stream : (cudaStream_t)0;
    FADEV_TRY(params->dtype == FADEV_NATIVE_FP16 ? native_forward_dispatch<__half>(params, a)
                                                 : native_forward_dispatch<__nv_bfloat16>(params, a));
    return native_finish(params, "fadev_cuda_native_forward");
}
