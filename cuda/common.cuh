/* Shared by every cuda/*.cu file: the per-thread CUDA error message, the checks that turn a CUDA error into
 * FADEV_ERR_CUDA (never an exit), and the device guard every entry point starts with. */
#ifndef FADEV_CUDA_COMMON_CUH
#define FADEV_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "../csrc/fadev.h"

/* Records "where: CUDA's message" as this thread's last error; returns FADEV_ERR_NO_MEMORY for
 * cudaErrorMemoryAllocation, else FADEV_ERR_CUDA. Clears a non-sticky error so the next call starts clean. */
fadev_status fadev_cuda_fail(cudaError_t err, const char *where);
/* Records a message of our own (no CUDA error behind it) and returns `st`. */
fadev_status fadev_cuda_fail_msg(fadev_status st, const char *message);
/* FADEV_OK if a device is usable, else FADEV_ERR_NO_CUDA with a message. */
fadev_status fadev_cuda_require_device(void);
/* Reports a failed launch, then waits for the device and reports an asynchronous fault. */
fadev_status fadev_cuda_finish(const char *where);
/* The end of an entry point: fadev_cuda_finish, or with `asynchronous` (the kernels queued on a caller's stream,
 * as a CUDA library call leaves them) only the launch errors. */
fadev_status fadev_cuda_end(int asynchronous, const char *where);
/* Device scratch one emulated call may hold: min(2 GiB, a third of the free memory), lowered by the environment's
 * FADEV_CUDA_SCRATCH_BYTES (tests: small problems chunked as large ones are). */
fadev_status fadev_cuda_scratch_budget(size_t *budget);
/* Whether `bytes` of scratch fit that budget, in *fits; without asking the driver for the free memory where the
 * device's memory pool already holds that much unused (a call's score store, kept by the pool since the last call). */
fadev_status fadev_cuda_scratch_fits(size_t bytes, int *fits);
/* The current device's SM count, the most dynamic shared memory a block may opt in to, its compute capability (each
 * read once a device). */
fadev_status fadev_cuda_sm_count(int *sms);
fadev_status fadev_cuda_smem_optin(int *bytes);
fadev_status fadev_cuda_capability(int *major, int *minor);
/* cudaFuncSetAttribute(kernel, MaxDynamicSharedMemorySize, bytes) on the current device, once: again only to grow it. */
fadev_status fadev_cuda_smem_attr(const void *kernel, int bytes);

#define CUDA_TRY(call)                                                   \
    do {                                                                 \
        cudaError_t err_ = (call);                                       \
        if (err_ != cudaSuccess) return fadev_cuda_fail(err_, #call);    \
    } while (0)

#define FADEV_TRY(call)                                \
    do {                                               \
        fadev_status st_ = (call);                     \
        if (st_ != FADEV_OK) return st_;               \
    } while (0)

/* A device allocation freed when it leaves scope (so early error returns cannot leak). It comes from the device's
 * default memory pool, stream-ordered on the legacy default stream every fadev kernel that uses it runs on
 * (cudaMallocAsync: CUDA's own caching allocator), so a call's scratch costs no cudaMalloc / cudaFree and no
 * device synchronisation once the pool holds it; fadev_cuda_require_device() sets how much the pool keeps between
 * calls. Where the device has no memory pools, plain cudaMalloc / cudaFree. */
template <typename T> struct device_buffer {
    T *ptr = nullptr;
    bool pooled = false;
    device_buffer() = default;
    device_buffer(const device_buffer &) = delete;
    device_buffer &operator=(const device_buffer &) = delete;
    ~device_buffer() {
        if (!ptr) return;
        if (pooled) cudaFreeAsync(ptr, 0);
        else cudaFree(ptr);
    }
    fadev_status alloc(size_t count, const char *what) {
        if (count == 0) count = 1;
        if (count > (size_t)-1 / sizeof(T)) return FADEV_ERR_OVERFLOW;
        cudaError_t err = cudaMallocAsync((void **)&ptr, count * sizeof(T), 0);
        if (err == cudaSuccess) {
            pooled = true;
            return FADEV_OK;
        }
        if (err == cudaErrorNotSupported) { /* no memory pools on this device */
            cudaGetLastError();
            err = cudaMalloc((void **)&ptr, count * sizeof(T));
            if (err == cudaSuccess) return FADEV_OK;
        }
        ptr = nullptr;
        return fadev_cuda_fail(err, what);
    }
};

/* Several scratch buffers carved from one device_buffer, each aligned to 256 bytes as cudaMalloc's are: a call
 * that needed ten allocations and ten frees (microseconds of host time each) makes one of each. `add` reserves
 * a region (in the planning pass, before `alloc`); `at` is its address afterwards, nullptr for an empty one. */
struct device_arena {
    device_buffer<unsigned char> mem;
    size_t total = 0;
    size_t add(size_t bytes) {
        const size_t off = total;
        total += (bytes + 255) & ~(size_t)255;
        return bytes ? off : (size_t)-1;
    }
    fadev_status alloc(const char *what) { return mem.alloc(total, what); }
    template <typename T> T *at(size_t off) const { return off == (size_t)-1 ? nullptr : (T *)(mem.ptr + off); }
};

/* Shared memory addresses and asynchronous global -> shared copies (cp.async, sm_80+); `valid` false writes zeros
 * and reads nothing (src must still be a valid address: callers pass the tensor's base). Every kernel's copies are
 * these. */
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async_16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_8(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 8 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_4(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

#endif /* FADEV_CUDA_COMMON_CUH */
