/* Rounded inputs of the emulated kernels on the GPU (emu.cuh): Q = R_input(q), K = R_input(k),
 * V = R_input(v) element-wise with the CPU's counters (events 0, 1, 2: stream id + 32 * head, index (row, d, 0)),
 * fp32 copies where the float tier may be used, and per K/V head the smallest nonzero and largest magnitude
 * and whether every value is finite (mag_add's rules), which decide that tier exactly as att_init does. */
#include <stdlib.h>

#include "emu.cuh"

/* One launch per tensor: blockIdx.y is the head; each thread walks a stride of that head's rows x D values
 * and the block folds its magnitudes into the head's record (emu_mag_flush: one atomic per block). */
__global__ void round_inputs_kernel(const double *src, double *dst, float *dstf, int64_t rows, int64_t dim,
                                    att_stage in, int stage_id, emu_mag *mag, int64_t head0) {
    const int64_t head = head0 + blockIdx.y, per_head = rows * dim;
    const double *s = src + head * per_head;
    double *d_out = dst + head * per_head;
    float *f_out = dstf ? dstf + head * per_head : nullptr;
    const uint64_t stream = ATT_STREAM(stage_id, head);
    unsigned long long lo = 0x7FF0000000000000ull, hi = 0;
    int finite = 1;
    for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < per_head; e += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = e / dim, col = e % dim;
        const double x = emu_round(in, s[e], stream, ATT_INDEX(row, col, 0));
        d_out[e] = x;
        if (f_out) f_out[e] = (float)x;
        emu_mag_put(lo, hi, finite, x);
    }
    if (mag) emu_mag_flush(mag + head, lo, hi, finite);
}

static fadev_status round_tensor(const double *src, device_buffer<double> &dst, device_buffer<float> &dstf,
                                 int want_float, device_buffer<emu_mag> *mag, int64_t heads, int64_t rows,
                                 int64_t dim, const att_stage &in, int stage_id) {
    const size_t n = (size_t)(heads * rows * dim);
    FADEV_TRY(dst.alloc(n, "emulated attention: rounded inputs"));
    if (want_float) FADEV_TRY(dstf.alloc(n, "emulated attention: fp32 inputs"));
    if (mag) {
        FADEV_TRY(mag->alloc((size_t)heads, "emulated attention: magnitudes"));
        emu_mag_reset_kernel<<<emu_blocks((size_t)heads, 256), 256>>>(mag->ptr, heads);
        CUDA_TRY(cudaGetLastError());
    }
    const unsigned threads = 256;
    unsigned per_head = emu_blocks((size_t)(rows * dim), threads);
    if (per_head > 64) per_head = 64;
    for (int64_t h0 = 0; h0 < heads; h0 += 65535) { /* gridDim.y is at most 65535 */
        const int64_t hn = heads - h0 < 65535 ? heads - h0 : 65535;
        round_inputs_kernel<<<dim3(per_head, (unsigned)hn), threads>>>(
            src, dst.ptr, want_float ? dstf.ptr : nullptr, rows, dim, in, stage_id, mag ? mag->ptr : nullptr, h0);
        CUDA_TRY(cudaGetLastError());
    }
    return FADEV_OK;
}

fadev_status emu_prepare(emu_ctx *cx, emu_inputs *store, const double *q, const double *k, const double *v,
                         const fadev_attention_params *params, const fadev_policy *pol, int exp2) {
    memset(cx, 0, sizeof *cx);
    att_plan_init(cx, params, pol, exp2); /* the stages and constants of att_init */
    const int64_t B = params->batch, D = params->dim;
    FADEV_TRY(round_tensor(q, store->q, store->qf, cx->qk_float, &store->qmag, B * params->heads, params->seq_q, D,
                           cx->input, ATT_IN_Q));
    FADEV_TRY(round_tensor(k, store->k, store->kf, cx->qk_float, &store->kmag, B * params->heads_kv, params->seq_kv, D,
                           cx->input, ATT_IN_K));
    FADEV_TRY(round_tensor(v, store->v, store->vf, cx->pv_float, &store->vmag, B * params->heads_kv, params->seq_kv, D,
                           cx->input, ATT_IN_V));
    cx->q = store->q.ptr, cx->k = store->k.ptr, cx->v = store->v.ptr;
    cx->qf = store->qf.ptr, cx->kf = store->kf.ptr, cx->vf = store->vf.ptr;
    cx->qmag = store->qmag.ptr, cx->kmag = store->kmag.ptr, cx->vmag = store->vmag.ptr;
    return FADEV_OK;
}
