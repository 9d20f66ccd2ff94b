/* Rounded inputs of the emulated kernels on the GPU (emu.cuh): Q = R_input(q), K = R_input(k),
 * V = R_input(v) element-wise with the CPU's counters (events 0, 1, 2: stream id + 32 * head, index (row, d, 0)),
 * fp32 copies where the float tier may be used, and per K/V head the smallest nonzero and largest magnitude
 * and whether every value is finite (mag_add's rules), which decide that tier exactly as att_init does. */
#include <stdlib.h>

#include "emu.cuh"

/* The three tensors' jobs in one launch: blockIdx.z is the tensor, blockIdx.y the head (from head0), and each thread
 * walks a stride of that head's rows x D values; the block folds its magnitudes into the head's record
 * (emu_mag_flush: one atomic per block). */
struct round_job {
    const double *src;
    double *dst;  /* nullptr: no fp64 copy */
    float *dstf; /* nullptr: no fp32 copy */
    emu_mag *mag;
    int64_t heads, rows;
    int stage_id;
};
struct round_jobs {
    round_job t[3];
};

/* FK: the input stage's flt_kind (emu.cuh). FLT_EVENT: each value's event (att_round_fast, else the general
 * rounding), the magnitudes on its fp64 encoding. FLT_F32, FLT_BF16, FLT_F16 (the presets' inputs): a finite value
 * by dbl_round, which is that event's value for every finite fp64 input (emu.cuh: a conversion, or round to odd at
 * fp32 and the format's nearest-even conversion), and the magnitudes on the result's fp32 encoding: the result is an
 * fp32 value, so its magnitude's order and its fp64 encoding (the conversion is exact) are the fp64 value's; a
 * non-finite value takes the event's own path, whose result is non-finite too. H200, B 1 H 16 N 4096 D 64 (fa2's
 * inputs, fp32 copies only): the events' kernel 54 us (SM 63% busy, DRAM 60%), by kind 48-50 us (SM 37.5%, DRAM
 * 66%, L2 81%: the loads bound it; ncu and A/B in benchmarks/README.md). */
template <int FK>
__global__ void round_inputs_kernel(const __grid_constant__ round_jobs jobs, int64_t dim, att_stage in, int64_t head0) {
    const round_job &j = jobs.t[blockIdx.z];
    const int64_t head = head0 + blockIdx.y, per_head = j.rows * dim;
    if (head >= j.heads) return;
    const double *s = j.src + head * per_head;
    double *d_out = j.dst ? j.dst + head * per_head : nullptr;
    float *f_out = j.dstf ? j.dstf + head * per_head : nullptr;
    const uint64_t stream = ATT_STREAM(j.stage_id, head);
    unsigned long long lo = 0x7FF0000000000000ull, hi = 0;
    unsigned lo32 = 0x7F800000u, hi32 = 0; /* FK != FLT_EVENT: the magnitudes' fp32 encodings */
    int finite = 1;
    /* UNR elements a thread in flight, their loads issued before any is rounded, and the general rounding out of line
     * (inlined, it held 66 registers). H200, fa2's D 64 inputs (150 MB read and written): one at a time and 64 blocks
     * a head, 70 us; this, 54 us (the bandwidth bound is ~31 us) */
    constexpr int UNR = 8;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    auto event = [&](int64_t e, double v) { /* emu_round's own fast path first: the event index (two 64-bit
                                             * divisions) only where it is read */
        double x;
        if (!att_round_fast(&in, v, &x)) x = emu_round_general(&in, v, stream, ATT_INDEX(e / dim, e % dim, 0));
        if (d_out) d_out[e] = x;
        if (f_out) f_out[e] = (float)x;
        return x;
    };
    auto put = [&](int64_t e, double v) {
        if constexpr (FK == FLT_EVENT) {
            emu_mag_put(lo, hi, finite, event(e, v));
        } else if (!(fabs(v) <= 1.7976931348623157e308)) {
            event(e, v), finite = 0;
        } else {
            const float x = dbl_round(FK, v);
            if (d_out) d_out[e] = (double)x;
            if (f_out) f_out[e] = x;
            const unsigned m = __float_as_uint(x) & 0x7FFFFFFFu;
            if (m >= 0x7F800000u) finite = 0; /* rounded to an infinity */
            else if (m) lo32 = m < lo32 ? m : lo32, hi32 = m > hi32 ? m : hi32;
        }
    };
    int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    for (; e + (UNR - 1) * stride < per_head; e += UNR * stride) {
        double v[UNR];
#pragma unroll
        for (int u = 0; u < UNR; u++) v[u] = __ldcs(s + e + u * stride); /* read once: streamed past the caches */
#pragma unroll
        for (int u = 0; u < UNR; u++) put(e + u * stride, v[u]);
    }
    for (; e < per_head; e += stride) put(e, s[e]);
    if constexpr (FK != FLT_EVENT) { /* fp32 +inf (nothing seen) is fp64's +inf: the records' starting value */
        lo = fadev_bits_of((double)__uint_as_float(lo32));
        hi = fadev_bits_of((double)__uint_as_float(hi32));
    }
    emu_mag_flush(j.mag + head, lo, hi, finite);
}

fadev_status emu_prepare(emu_ctx *cx, emu_inputs *store, const double *q, const double *k, const double *v,
                         const fadev_attention_params *params, const fadev_policy *pol, int exp2, int fp64) {
    memset(cx, 0, sizeof *cx);
    att_plan_init(cx, params, pol, exp2); /* the stages and constants of att_init */
    const int64_t B = params->batch, D = params->dim, hq = B * params->heads, hk = B * params->heads_kv;
    const size_t nq = (size_t)(hq * params->seq_q * D), nk = (size_t)(hk * params->seq_kv * D);
    const int fq = cx->qk_float, fv = cx->pv_float;
    /* the fp64 copies only where a generic kernel may read every head: 8 of the 20 bytes an element the rounding
     * wrote (H100: 112 us of fa2's 2.8 ms D 64 forward, the kernel at ~75% of the memory bandwidth) */
    const size_t n64 = fp64 || !emu_fast_forward_ok(*cx, pol) ? 1 : 0;
    /* one allocation: q, k, v in fp64, their fp32 copies where the float tier may be used, the magnitudes, the work
     * counter */
    device_arena &m = store->mem;
    const size_t oq = m.add(n64 * nq * 8), ok = m.add(n64 * nk * 8), ov = m.add(n64 * nk * 8),
                 oqf = m.add(fq ? nq * 4 : 0), okf = m.add(fq ? nk * 4 : 0), ovf = m.add(fv ? nk * 4 : 0),
                 omag = m.add((hq + 2 * hk) * sizeof(emu_mag)), oticket = m.add(sizeof(unsigned));
    FADEV_TRY(m.alloc("emulated attention: rounded inputs"));
    double *rq = m.at<double>(oq), *rk = m.at<double>(ok), *rv = m.at<double>(ov);
    float *fq32 = m.at<float>(oqf), *fk32 = m.at<float>(okf), *fv32 = m.at<float>(ovf);
    emu_mag *mags = m.at<emu_mag>(omag);
    cx->q = rq, cx->k = rk, cx->v = rv, cx->qf = fq32, cx->kf = fk32, cx->vf = fv32;
    cx->qmag = mags, cx->kmag = mags + hq, cx->vmag = mags + hq + hk;
    cx->ticket = m.at<unsigned>(oticket);
    emu_mag_reset_kernel<<<emu_blocks((size_t)(hq + 2 * hk), 256), 256>>>(mags, hq + 2 * hk, cx->ticket);
    CUDA_TRY(cudaGetLastError());
    const round_jobs jobs = {{{q, rq, fq32, mags, hq, params->seq_q, ATT_IN_Q},
                              {k, rk, fk32, mags + hq, hk, params->seq_kv, ATT_IN_K},
                              {v, rv, fv32, mags + hq + hk, hk, params->seq_kv, ATT_IN_V}}};
    const unsigned threads = 256;
    const int64_t longest = params->seq_q > params->seq_kv ? params->seq_q : params->seq_kv;
    /* blocks a head: at least 32 elements a thread, at most 32 blocks, and about 2048 blocks in all where there are
     * many heads (at least 8 a head). H200, the kernel's time by blocks a head (8 / 14 / 20 / 32 / 64): B 1, H 16,
     * N 4096, D 64: 53 / 59 / 56 / 53 / 56 us; D 128: 103 / 112 / 105 / 100 / 102; B 8, H 8/4, N 1024 (the Llama
     * step's): 41 / 45 / 53 / 54 / 97; B 16, H 16, 128 queries, 4096 keys: 499 / 517 / 542 / 553 / 608 */
    const int64_t by_count = 2048 / (3 * hq) > 8 ? 2048 / (3 * hq) : 8;
    int64_t blocks = (longest * D + threads * 32 - 1) / (threads * 32);
    blocks = blocks < by_count ? blocks : by_count;
    const unsigned per_head = (unsigned)(blocks < 1 ? 1 : blocks > 32 ? 32 : blocks);
    for (int64_t h0 = 0; h0 < hq; h0 += 65535) { /* gridDim.y is at most 65535; K/V have no more heads than Q */
        const int64_t hn = hq - h0 < 65535 ? hq - h0 : 65535;
        const dim3 grid(per_head, (unsigned)hn, 3);
        switch (flt_kind_of(cx->input)) {
        case FLT_F32: round_inputs_kernel<FLT_F32><<<grid, threads>>>(jobs, D, cx->input, h0); break;
        case FLT_BF16: round_inputs_kernel<FLT_BF16><<<grid, threads>>>(jobs, D, cx->input, h0); break;
        case FLT_F16: round_inputs_kernel<FLT_F16><<<grid, threads>>>(jobs, D, cx->input, h0); break;
        default: round_inputs_kernel<FLT_EVENT><<<grid, threads>>>(jobs, D, cx->input, h0);
        }
        CUDA_TRY(cudaGetLastError());
    }
    return FADEV_OK;
}
