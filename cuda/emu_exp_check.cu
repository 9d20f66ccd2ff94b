/* fadev_cuda_round_check (flt_round's conversions against the rule on the encoding), fadev_cuda_quot_check (the
 * baseline's P = R_p(e / l) from l's reciprocal: quot_round_rcp against quot_round) and
 * fadev_cuda_exp_check: emu_exp_fast (emu.cuh: libdevice's exp and exp2 transcribed, constants in constant memory)
 * against CUDA's exp and exp2 themselves (emu_exp), bit for bit, for every fp32 input in a range of encodings: the
 * fast kernels call emu_exp_fast only on fp32 values (their softmax terms), so the full range 0 .. 2^32 proves them
 * the same function there. tests/test_cuda_emulated_fast.py runs it over all 2^32. */
#include <stdint.h>

#include "emu.cuh"
#include "emu_forward_fast.cuh"

using emu_fwd::quot_round;
using emu_fwd::quot_round_rcp;

namespace {

__global__ void exp_check_kernel(int exp2_form, int ref_form, uint64_t start, uint64_t end, unsigned long long *bad) {
    unsigned long long mine = 0;
    for (uint64_t u = start + blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; u < end; u += (uint64_t)gridDim.x * blockDim.x) {
        const double x = (double)__uint_as_float((unsigned)u);
        mine += fadev_bits_of(emu_exp_fast(exp2_form, x)) != fadev_bits_of(emu_exp(ref_form, x));
    }
    if (mine) atomicAdd(bad, mine);
}

/* quot_round_rcp<K> against quot_round for e every 16-bit value in [0, 1] (K's encodings 0 .. one) and l = (1 + f) 2^s,
 * s <= 12, 4096 fractions f; with `naive`, R_K(RN32(e rl)) in its place (the check's own test that it sees a difference). */
template <int K>
__global__ void quot_check_kernel(unsigned ne, int naive, unsigned long long *bad) {
    unsigned long long mine = 0;
    const uint64_t n = (uint64_t)ne * 4096 * 13;
    for (uint64_t u = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; u < n; u += (uint64_t)gridDim.x * blockDim.x) {
        const unsigned h = (unsigned)(u % ne);
        const float e = K == FLT_BF16 ? __uint_as_float(h << 16) : __half2float(__ushort_as_half((unsigned short)h));
        const unsigned k = (unsigned)(u / ne % 4096);
        /* even k: 1 + k 2^-12; odd k: a 23-bit fraction (a row sum's l has every bit: bf16's quotients of 12-bit l
         * never come near enough to a midpoint for the bounds' test to matter) */
        const float f = k & 1 ? (float)((k * 2654435761u) >> 9) * 0x1p-23f : (float)k * 0x1p-12f;
        const float l = ldexpf(1.f + f, (int)(u / ne / 4096));
        const float rl = __frcp_rn(l);
        const float got = naive ? flt_round(K, __fmul_rn(e, rl)) : quot_round_rcp<K>(e, l, rl);
        mine += fadev_bits_of(got) != fadev_bits_of(quot_round(K, e, l));
    }
    if (mine) atomicAdd(bad, mine);
}

} // namespace

namespace {

/* fp16's nearest-even rounding of the fp32 value of encoding u (not a NaN) by the rule on the encoding, without the
 * conversion it checks: 10 fraction bits where the result is normal, a multiple of 2^-24 below 2^-14, inf from 65520
 * (65504 and half its ulp; that tie goes to the even 2^16) */
__host__ __device__ inline float f16_rule(unsigned u) {
    const unsigned a = u & 0x7FFFFFFFu;
    union { unsigned u; float f; } r;
    if (a >= 0x477FF000u) {
        r.u = 0x7F800000u;
    } else if (a >= 0x38800000u) { /* >= 2^-14 */
        r.u = (a + 0xFFFu + ((a >> 13) & 1u)) & 0xFFFFE000u;
    } else { /* n 2^-24, n the nearest-even integer to a's value / 2^-24 = m 2^-s */
        const int e = (int)(a >> 23), s = 126 - (e ? e : 1);
        const unsigned m = e ? (a & 0x7FFFFFu) | 0x800000u : a & 0x7FFFFFu;
        unsigned n = 0;
        if (s <= 25) {
            const unsigned rem = m & ((1u << s) - 1u), half = 1u << (s - 1);
            n = (m >> s) + (rem > half || (rem == half && ((m >> s) & 1u)));
        }
        r.f = (float)n * 0x1p-24f;
    }
    return u >> 31 ? -r.f : r.f;
}

/* flt_round (the hardware's conversions) against the rule on the encoding for every fp32 input (a NaN against a
 * NaN); with `naive`, truncation in flt_round's place (the check's own test that it sees a difference). */
template <int K>
__global__ void round_check_kernel(int naive, unsigned long long *bad) {
    unsigned long long mine = 0;
    for (uint64_t u = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; u < (1ull << 32); u += (uint64_t)gridDim.x * blockDim.x) {
        const float x = __uint_as_float((unsigned)u);
        float want;
        if (x != x) want = x;
        else if (K == FLT_BF16) want = __uint_as_float(((unsigned)u + 0x7FFFu + (((unsigned)u >> 16) & 1u)) & 0xFFFF0000u);
        else want = f16_rule((unsigned)u);
        const float got = !naive ? flt_round(K, x)
                          : K == FLT_BF16 ? __uint_as_float((unsigned)u & 0xFFFF0000u) : __half2float(__float2half_rz(x));
        mine += want != want ? got == got : fadev_bits_of(got) != fadev_bits_of(want);
    }
    if (mine) atomicAdd(bad, mine);
}

} // namespace

extern "C" fadev_status fadev_cuda_round_check(int bf16, int naive, uint64_t *mismatches) {
    if (!mismatches) return FADEV_ERR_INVALID_ARGUMENT;
    FADEV_TRY(fadev_cuda_require_device());
    device_buffer<unsigned long long> bad;
    FADEV_TRY(bad.alloc(1, "fadev_cuda_round_check: cudaMalloc"));
    CUDA_TRY(cudaMemsetAsync(bad.ptr, 0, sizeof(unsigned long long), 0));
    if (bf16) round_check_kernel<FLT_BF16><<<4096, 256>>>(naive != 0, bad.ptr);
    else round_check_kernel<FLT_F16><<<4096, 256>>>(naive != 0, bad.ptr);
    unsigned long long host = 0;
    CUDA_TRY(cudaGetLastError());
    CUDA_TRY(cudaMemcpy(&host, bad.ptr, sizeof host, cudaMemcpyDeviceToHost));
    *mismatches = host;
    return FADEV_OK;
}

extern "C" fadev_status fadev_cuda_quot_check(int bf16, int naive, uint64_t *mismatches, uint64_t *pairs) {
    if (!mismatches || !pairs) return FADEV_ERR_INVALID_ARGUMENT;
    FADEV_TRY(fadev_cuda_require_device());
    device_buffer<unsigned long long> bad;
    FADEV_TRY(bad.alloc(1, "fadev_cuda_quot_check: cudaMalloc"));
    CUDA_TRY(cudaMemsetAsync(bad.ptr, 0, sizeof(unsigned long long), 0));
    const unsigned ne = bf16 ? 0x3F81u : 0x3C01u; /* encodings of 0 .. 1 */
    if (bf16) quot_check_kernel<FLT_BF16><<<4096, 256>>>(ne, naive != 0, bad.ptr);
    else quot_check_kernel<FLT_F16><<<4096, 256>>>(ne, naive != 0, bad.ptr);
    unsigned long long host = 0;
    CUDA_TRY(cudaGetLastError());
    CUDA_TRY(cudaMemcpy(&host, bad.ptr, sizeof host, cudaMemcpyDeviceToHost));
    *mismatches = host, *pairs = (uint64_t)ne * 4096 * 13;
    return FADEV_OK;
}

extern "C" fadev_status fadev_cuda_exp_check(int exp2_form, int ref_form, uint64_t start, uint64_t count,
                                            uint64_t *mismatches) {
    if (!mismatches || start > ((uint64_t)1 << 32) || count > ((uint64_t)1 << 32) - start) return FADEV_ERR_INVALID_ARGUMENT;
    FADEV_TRY(fadev_cuda_require_device());
    device_buffer<unsigned long long> bad;
    FADEV_TRY(bad.alloc(1, "fadev_cuda_exp_check: cudaMalloc"));
    CUDA_TRY(cudaMemsetAsync(bad.ptr, 0, sizeof(unsigned long long), 0));
    exp_check_kernel<<<emu_blocks(count, 256) < 4096 ? emu_blocks(count, 256) : 4096, 256>>>(exp2_form != 0, ref_form != 0,
                                                                                           start, start + count, bad.ptr);
    unsigned long long host = 0;
    CUDA_TRY(cudaGetLastError());
    CUDA_TRY(cudaMemcpy(&host, bad.ptr, sizeof host, cudaMemcpyDeviceToHost));
    *mismatches = host;
    return FADEV_OK;
}
