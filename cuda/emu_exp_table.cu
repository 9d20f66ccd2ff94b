/* The lean forward's softmax terms from a table (issue 24): where the softmax stage is bf16 or fp16 under
 * nearest-even, a term e = R(E(x)) is a function of x = R(s - m) alone, a value of that 16-bit format, and x <= 0 in
 * the flash kernels (m is the maximum of the row's scores so far, this block's included). So the term is one of at
 * most 2^15 values, indexed by x's magnitude bits. The table holds them for every magnitude from -0 to -inf, computed
 * on the device by the very functions the kernels call (dbl_round of emu_exp_fast), and the kernels read it between
 * lo and hi, the magnitudes below which every term equals -0's (1: x too small to move E(x) off 1 in the format) and
 * above which every term equals -inf's (0: E(x) underflows), both read off the table's own values: a lookup
 * (tab_term, emu_forward_fast.cuh) gives the computation's bits for every x <= 0, by construction, and
 * fadev_cuda_exp_table_check compares the two for all 2^16 encodings. What it saves: the fp64 exp (a dependent chain of
 * 14 DFMA, whose latency the softmax terms' warps waited on, ncu) and the conversions around it: paper(bf16)'s
 * forward 296 -> 276 instructions a score, 7% faster (H100, benchmarks/README.md); the hot part of the table (bf16:
 * ~2,000 entries, 4 KB) stays in L1. A table a device, format and exp form, built at its first use and kept for the
 * process (64 KB). */
#include <array>
#include <map>
#include <mutex>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "emu_forward_fast.cuh"

using namespace emu_fwd;

namespace {

/* f[m] = the term of x = -(the value of magnitude bits m) for m < n (n - 1: -inf), f[n] the term of x = +0 */
__global__ void exp_terms_kernel(unsigned short *f, int fk, int exp2_form, int n) {
    const int m = blockIdx.x * blockDim.x + threadIdx.x;
    if (m > n) return;
    float x = 0.f;
    if (m < n)
        x = fk == FLT_BF16 ? __uint_as_float(0x80000000u | (unsigned)m << 16)
                           : -__half2float(__ushort_as_half((unsigned short)m));
    const float e = dbl_round(fk, emu_exp_fast(exp2_form, (double)x));
    f[m] = fk == FLT_BF16 ? (unsigned short)(__float_as_uint(e) >> 16) : __half_as_ushort(__float2half_rn(e));
}

/* mismatches of tab_term against the computation over every 16-bit encoding whose value is <= 0 (ref_form: the exp
 * form of the computation; the table's other form is the check's test that it sees a difference) */
template <int K>
__global__ void exp_table_check_kernel(exp_tab tb, int ref_form, unsigned long long *bad) {
    const unsigned u = blockIdx.x * blockDim.x + threadIdx.x;
    if (u > 0xFFFFu) return;
    const float x = K == FLT_BF16 ? __uint_as_float(u << 16) : __half2float(__ushort_as_half((unsigned short)u));
    if (!(x <= 0.f)) return;
    const float want = dbl_round(K, emu_exp_fast(ref_form, (double)x));
    if (__float_as_uint(tab_term<K>(tb, x)) != __float_as_uint(want)) atomicAdd(bad, 1ull);
}

} // namespace

fadev_status emu_fwd::exp_table_of(int fk, int exp2_form, exp_tab &out) {
    out = exp_tab{nullptr, 0, 0};
    if (fk != FLT_BF16 && fk != FLT_F16) return FADEV_OK;
    const char *off = getenv("FADEV_EMU_EXP_TABLE"); /* tests and benchmarks: 0 computes every term */
    if (off && strcmp(off, "0") == 0) return FADEV_OK;
    int device = 0;
    CUDA_TRY(cudaGetDevice(&device));
    static std::mutex mu;
    static std::map<std::array<int, 3>, exp_tab> made;
    std::lock_guard<std::mutex> hold(mu);
    const std::array<int, 3> key{device, fk, exp2_form != 0};
    const auto it = made.find(key);
    if (it != made.end()) return out = it->second, FADEV_OK;
    const int n = fk == FLT_BF16 ? 0x7F81 : 0x7C01; /* magnitudes 0 .. inf's */
    unsigned short *t = nullptr;                     /* kept for the process (not a device_buffer) */
    CUDA_TRY(cudaMalloc((void **)&t, (n + 1) * sizeof *t));
    /* on the legacy default stream, and waited for by the copy back: ready before any kernel that reads it */
    exp_terms_kernel<<<(n + 256) / 256, 256>>>(t, fk, exp2_form != 0, n);
    std::vector<unsigned short> h(n + 1);
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpy(h.data(), t, h.size() * sizeof h[0], cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) {
        cudaFree(t);
        return fadev_cuda_fail(err, "emulated attention: the softmax terms' table");
    }
    int lo = 0, hi = n - 1;
    while (lo + 1 < n && h[lo + 1] == h[0]) lo++;
    while (hi > 0 && h[hi - 1] == h[n - 1]) hi--;
    if (h[n] != h[0]) { /* +0's term is -0's (E(+-0) = 1); were it not, no table */
        cudaFree(t);
        t = nullptr;
    }
    out = made[key] = exp_tab{t, lo, hi};
    return FADEV_OK;
}

extern "C" fadev_status fadev_cuda_exp_table_check(int bf16, int exp2_form, int ref_form, uint64_t *mismatches,
                                                   int *lo, int *hi) {
    if (!mismatches || !lo || !hi) return FADEV_ERR_INVALID_ARGUMENT;
    FADEV_TRY(fadev_cuda_require_device());
    exp_tab tb;
    FADEV_TRY(exp_table_of(bf16 ? FLT_BF16 : FLT_F16, exp2_form, tb));
    if (!tb.t) return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "exp_table_check: no table (FADEV_EMU_EXP_TABLE=0?)");
    device_buffer<unsigned long long> bad;
    FADEV_TRY(bad.alloc(1, "fadev_cuda_exp_table_check: cudaMalloc"));
    CUDA_TRY(cudaMemsetAsync(bad.ptr, 0, sizeof(unsigned long long), 0));
    if (bf16) exp_table_check_kernel<FLT_BF16><<<256, 256>>>(tb, ref_form != 0, bad.ptr);
    else exp_table_check_kernel<FLT_F16><<<256, 256>>>(tb, ref_form != 0, bad.ptr);
    CUDA_TRY(cudaGetLastError());
    unsigned long long host = 0;
    CUDA_TRY(cudaMemcpy(&host, bad.ptr, sizeof host, cudaMemcpyDeviceToHost));
    *mismatches = host, *lo = tb.lo, *hi = tb.hi;
    return FADEV_OK;
}
