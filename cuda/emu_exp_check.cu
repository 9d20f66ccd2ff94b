/* fadev_cuda_exp_check: emu_exp_fast (emu.cuh: libdevice's exp and exp2 transcribed, constants in constant memory)
 * against CUDA's exp and exp2 themselves (emu_exp), bit for bit, for every fp32 input in a range of encodings: the
 * fast kernels call emu_exp_fast only on fp32 values (their softmax terms), so the full range 0 .. 2^32 proves them
 * the same function there. tests/test_cuda_emulated_fast.py runs it over all 2^32. */
#include <stdint.h>

#include "emu.cuh"

namespace {

__global__ void exp_check_kernel(int exp2_form, int ref_form, uint64_t start, uint64_t end, unsigned long long *bad) {
    unsigned long long mine = 0;
    for (uint64_t u = start + blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; u < end; u += (uint64_t)gridDim.x * blockDim.x) {
        const double x = (double)__uint_as_float((unsigned)u);
        mine += fadev_bits_of(emu_exp_fast(exp2_form, x)) != fadev_bits_of(emu_exp(ref_form, x));
    }
    if (mine) atomicAdd(bad, mine);
}

} // namespace

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
