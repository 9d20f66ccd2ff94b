/* Rounded inputs of the emulated kernels on the GPU (emu.cuh): Q = R_input(q), K = R_input(k),
 * V = R_input(v) element-wise with the CPU's counters (events 0, 1, 2: stream id + 32 * head, index (row, d, 0)),
 * fp32 copies where the float tier may be used, and per K/V head the smallest nonzero and largest magnitude
 * and whether every value is finite (mag_add's rules), which decide that tier exactly as att_init does. */
#include <stdint.h>
#include <stdlib.h>

#include <mutex>

#include "emu.cuh"

/* The three tensors' jobs in one launch: blockIdx.z is the tensor, blockIdx.y the head (from head0), and each thread
 * walks a stride of that head's rows x D values. The magnitudes' records need no reset kernel before it (a launch on
 * the call's critical path: H200, 5-14 us of host time before the GPU had work, benchmarks/README.md): each block
 * writes its own record into `part`, and the head's last block to finish (a counter) folds them into the head's
 * record and puts the counter back to 0 for the next call (emu_counters). Block (0, 0, 0) zeroes the call's work
 * counter (ticket), which only kernels launched after this one read. */
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
    emu_mag *part;    /* [tensor][head][blockIdx.x]: each block's own record */
    unsigned *count;  /* [tensor][head]: blocks done, 0 between calls (emu_counters) */
    unsigned *ticket; /* the call's work counter, set to 0 */
    int64_t hq;       /* query heads of the call: the tensors' stride in part and count */
};

namespace {

/* The block's magnitudes (emu_mag_flush's block reduction) into the head's record: the block's own record, then,
 * in the head's last block, all of them folded by its first warp, a record a lane (__threadfence before the counter,
 * as CUDA's threadFenceReduction sample: every block's record is visible to the block that counts last; folded by
 * one thread, a chain of 32 L2 reads, the kernel took 4 us longer: H200, benchmarks/README.md). Every thread of the
 * block calls it. */
__device__ __forceinline__ void flush_head(const round_jobs &jobs, emu_mag *rec, int64_t slot, unsigned long long lo,
                                           unsigned long long hi, int finite) {
    __shared__ int last;
    emu_mag_reduce_block(lo, hi, finite);
    emu_mag *part = jobs.part + slot * gridDim.x;
    if (threadIdx.x == 0) {
        part[blockIdx.x] = emu_mag{lo, hi, finite};
        __threadfence();
        last = atomicAdd(jobs.count + slot, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x >= 32) return;
    __threadfence();
    lo = 0x7FF0000000000000ull, hi = 0, finite = 1;
    for (unsigned b = threadIdx.x; b < gridDim.x; b += 32) { /* L2 reads: not in this SM's L1 */
        const unsigned long long l2 = __ldcg(&part[b].min_bits), h2 = __ldcg(&part[b].max_bits);
        lo = l2 < lo ? l2 : lo, hi = h2 > hi ? h2 : hi;
        finite &= __ldcg(&part[b].finite);
    }
    emu_mag_reduce_warp(lo, hi, finite);
    if (threadIdx.x) return;
    *rec = emu_mag{lo, hi, finite};
    jobs.count[slot] = 0;
}

} // namespace

/* FK: the input stage's flt_kind (emu.cuh). FLT_EVENT: each value's event (att_round_fast, else the general
 * rounding), the magnitudes on its fp64 encoding. FLT_F32, FLT_BF16, FLT_F16 (the presets' inputs): a finite value
 * by dbl_round, which is that event's value for every finite fp64 input (emu.cuh: a conversion, or round to odd at
 * fp32 and the format's nearest-even conversion), and the magnitudes on the result's fp32 encoding: the result is an
 * fp32 value, so its magnitude's order and its fp64 encoding (the conversion is exact) are the fp64 value's; a
 * non-finite value takes the event's own path, whose result is non-finite too. U > 0 (those kinds, where D is even
 * and the pointers 16 bytes aligned): U pairs of values a thread, each a load (double2) and a store (float2,
 * double2); U = 0: UNR values, each a load and a store. MINB: blocks an SM (256 threads; 64 registers at 4, as the
 * kernel had before the head's last block folded the records; 84-88 without the bound). H200, B 1 H 16 N 4096 D 64,
 * fa2's inputs (fp32 copies only): the events' kernel 54 us (SM 63% busy, DRAM 60%), by kind 48-50 us (SM 37.5%,
 * DRAM 66%, L2 81%: the loads' latency bounds it; ncu in benchmarks/README.md). Tried (the same bits; time against
 * that kernel and its reset's): the next batch loaded while this one is rounded, 4 pairs, 1.21x (2 pairs, 4 blocks:
 * 1.11x); 8 pairs, 3 blocks 1.29x; 4 pairs, 4 blocks 1.07x, one at a time 1.10x -- with the records folded by one
 * thread of the last block (about 4 us of it; now its first warp). */
template <int FK, int U, int MINB>
__global__ void __launch_bounds__(256, MINB) round_inputs_kernel(const __grid_constant__ round_jobs jobs, int64_t dim, att_stage in, int64_t head0) {
    const round_job &j = jobs.t[blockIdx.z];
    const int64_t head = head0 + blockIdx.y, per_head = j.rows * dim;
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0 && head0 == 0) *jobs.ticket = 0;
    if (head >= j.heads) return;
    const double *s = j.src + head * per_head;
    double *d_out = j.dst ? j.dst + head * per_head : nullptr;
    float *f_out = j.dstf ? j.dstf + head * per_head : nullptr;
    const uint64_t stream = ATT_STREAM(j.stage_id, head);
    unsigned long long lo = 0x7FF0000000000000ull, hi = 0;
    unsigned lo32 = 0x7F800000u, hi32 = 0; /* FK != FLT_EVENT: the magnitudes' fp32 encodings */
    int finite = 1;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    auto event = [&](int64_t e, double v) { /* emu_round's own fast path first: the event index (two 64-bit
                                             * divisions) only where it is read */
        double x;
        if (!att_round_fast(&in, v, &x)) x = emu_round_general(&in, v, stream, ATT_INDEX(e / dim, e % dim, 0));
        return x;
    };
    auto value = [&](int64_t e, double v) { /* element e's rounded value, its magnitude folded in */
        if constexpr (FK == FLT_EVENT) {
            const double x = event(e, v);
            emu_mag_put(lo, hi, finite, x);
            return x;
        } else {
            if (!(fabs(v) <= 1.7976931348623157e308)) return finite = 0, event(e, v);
            const float x = dbl_round(FK, v);
            const unsigned m = __float_as_uint(x) & 0x7FFFFFFFu;
            if (m >= 0x7F800000u) finite = 0; /* rounded to an infinity */
            else if (m) lo32 = m < lo32 ? m : lo32, hi32 = m > hi32 ? m : hi32;
            return (double)x;
        }
    };
    auto put = [&](int64_t e, double v) {
        const double x = value(e, v);
        if (d_out) d_out[e] = x;
        if (f_out) f_out[e] = (float)x;
    };
    int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if constexpr (U > 0) {
        /* pair e2 holds elements 2 e2, 2 e2 + 1; U pairs a thread in flight */
        const int64_t n2 = per_head / 2;
        const double2 *s2 = (const double2 *)s;
        auto put2 = [&](int64_t at, double2 v) {
            const double x = value(2 * at, v.x), y = value(2 * at + 1, v.y);
            if (d_out) *(double2 *)(d_out + 2 * at) = make_double2(x, y);
            if (f_out) *(float2 *)(f_out + 2 * at) = make_float2((float)x, (float)y);
        };
        for (; e + (U - 1) * stride < n2; e += U * stride) {
            double2 v[U];
#pragma unroll
            for (int u = 0; u < U; u++) v[u] = __ldcs(s2 + e + u * stride); /* read once: streamed past the caches */
#pragma unroll
            for (int u = 0; u < U; u++) put2(e + u * stride, v[u]);
        }
        for (; e < n2; e += stride) put2(e, __ldcs(s2 + e));
    } else {
        /* UNR elements a thread in flight, their loads issued before any is rounded, and the general rounding out of
         * line (inlined, it held 66 registers). H200, fa2's D 64 inputs (150 MB read and written): one at a time and
         * 64 blocks a head, 70 us; this, 54 us (the bandwidth bound is ~31 us) */
        constexpr int UNR = 8;
        for (; e + (UNR - 1) * stride < per_head; e += UNR * stride) {
            double v[UNR];
#pragma unroll
            for (int u = 0; u < UNR; u++) v[u] = __ldcs(s + e + u * stride);
#pragma unroll
            for (int u = 0; u < UNR; u++) put(e + u * stride, v[u]);
        }
        for (; e < per_head; e += stride) put(e, s[e]);
    }
    if constexpr (FK != FLT_EVENT) { /* fp32 +inf (nothing seen) is fp64's +inf: the records' starting value */
        lo = fadev_bits_of((double)__uint_as_float(lo32));
        hi = fadev_bits_of((double)__uint_as_float(hi32));
    }
    flush_head(jobs, j.mag + head, blockIdx.z * jobs.hq + head, lo, hi, finite);
}

/* round_inputs_kernel<fk, U, MINB> for the kinds that round by dbl_round */
template <int U, int MINB>
static void launch_by_kind(int fk, dim3 grid, unsigned threads, const round_jobs &jobs, int64_t D, const att_stage &in,
                           int64_t h0) {
    if (fk == FLT_F32) round_inputs_kernel<FLT_F32, U, MINB><<<grid, threads>>>(jobs, D, in, h0);
    else if (fk == FLT_BF16) round_inputs_kernel<FLT_BF16, U, MINB><<<grid, threads>>>(jobs, D, in, h0);
    else round_inputs_kernel<FLT_F16, U, MINB><<<grid, threads>>>(jobs, D, in, h0);
}

/* Per device, counters at 0 between calls, one per tensor and head (round_inputs_kernel's): grown, never freed or
 * shrunk (a kernel queued with an older buffer may still run; the old buffers stay, at most as large as the newest
 * together). Every emulated kernel runs on the legacy default stream (fadev.cuda), so calls' rounding kernels never
 * overlap, and each leaves the counters it used at 0. */
static fadev_status emu_counters(size_t n, unsigned **out) {
    constexpr int MAX_DEVICES = 64;
    static std::mutex mu;
    static unsigned *have[MAX_DEVICES];
    static size_t size[MAX_DEVICES];
    int device = 0;
    CUDA_TRY(cudaGetDevice(&device));
    if (device < 0 || device >= MAX_DEVICES) return fadev_cuda_fail_msg(FADEV_ERR_CUDA, "emulated attention: device index");
    std::lock_guard<std::mutex> hold(mu);
    if (size[device] < n) {
        size_t grown = size[device] ? 2 * size[device] : 4096;
        while (grown < n) grown *= 2;
        unsigned *p = nullptr;
        CUDA_TRY(cudaMalloc((void **)&p, grown * sizeof *p));
        const cudaError_t err = cudaMemset(p, 0, grown * sizeof *p);
        if (err != cudaSuccess) {
            cudaFree(p);
            return fadev_cuda_fail(err, "emulated attention: counters");
        }
        have[device] = p, size[device] = grown;
    }
    *out = have[device];
    return FADEV_OK;
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
    /* one allocation: q, k, v in fp64, their fp32 copies where the float tier may be used, the magnitudes, the
     * blocks' own magnitudes, the work counter */
    device_arena &m = store->mem;
    const size_t oq = m.add(n64 * nq * 8), ok = m.add(n64 * nk * 8), ov = m.add(n64 * nk * 8),
                 oqf = m.add(fq ? nq * 4 : 0), okf = m.add(fq ? nk * 4 : 0), ovf = m.add(fv ? nk * 4 : 0),
                 omag = m.add((hq + 2 * hk) * sizeof(emu_mag)), opart = m.add(3 * hq * per_head * sizeof(emu_mag)),
                 oticket = m.add(sizeof(unsigned));
    FADEV_TRY(m.alloc("emulated attention: rounded inputs"));
    unsigned *count = nullptr;
    FADEV_TRY(emu_counters((size_t)(3 * hq), &count));
    double *rq = m.at<double>(oq), *rk = m.at<double>(ok), *rv = m.at<double>(ov);
    float *fq32 = m.at<float>(oqf), *fk32 = m.at<float>(okf), *fv32 = m.at<float>(ovf);
    emu_mag *mags = m.at<emu_mag>(omag);
    cx->q = rq, cx->k = rk, cx->v = rv, cx->qf = fq32, cx->kf = fk32, cx->vf = fv32;
    cx->qmag = mags, cx->kmag = mags + hq, cx->vmag = mags + hq + hk;
    cx->ticket = m.at<unsigned>(oticket);
    const round_jobs jobs = {{{q, rq, fq32, mags, hq, params->seq_q, ATT_IN_Q},
                              {k, rk, fk32, mags + hq, hk, params->seq_kv, ATT_IN_K},
                              {v, rv, fv32, mags + hq + hk, hk, params->seq_kv, ATT_IN_V}},
                             m.at<emu_mag>(opart), count, cx->ticket, hq};
    /* pairs: D even, and every source and copy 16 bytes aligned (the arena's are; a caller's view may not be) */
    const int pairs = D % 2 == 0 && ((uintptr_t)q | (uintptr_t)k | (uintptr_t)v) % 16 == 0;
    const int fk = flt_kind_of(cx->input);
    for (int64_t h0 = 0; h0 < hq; h0 += 65535) { /* gridDim.y is at most 65535; K/V have no more heads than Q */
        const int64_t hn = hq - h0 < 65535 ? hq - h0 : 65535;
        const dim3 grid(per_head, (unsigned)hn, 3);
        if (fk == FLT_EVENT) round_inputs_kernel<FLT_EVENT, 0, 1><<<grid, threads>>>(jobs, D, cx->input, h0);
        else if (pairs) launch_by_kind<4, 4>(fk, grid, threads, jobs, D, cx->input, h0);
        else launch_by_kind<0, 4>(fk, grid, threads, jobs, D, cx->input, h0);
        CUDA_TRY(cudaGetLastError());
    }
    return FADEV_OK;
}
