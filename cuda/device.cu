/* Device query and format rounding on the GPU.
 * fadev_cuda_round_f64 rounds n float64 values with the same scalar rule as the C core (round.h,
 * compiled here for the device), keyed by the same Philox counter, so the result is bit-identical
 * to fadev_round_f64 for every mode. Host pointers in and out; the copy is part of the call. */
#include <stdlib.h>

#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "common.cuh"
#include "../csrc/round.h"

static thread_local char last_error[512] = "";

fadev_status fadev_cuda_fail(cudaError_t err, const char *where) {
    snprintf(last_error, sizeof last_error, "%s: %s (%s)", where, cudaGetErrorString(err), cudaGetErrorName(err));
    cudaGetLastError(); /* clear a non-sticky error; a sticky one stays and is reported by every later call */
    return err == cudaErrorMemoryAllocation ? FADEV_ERR_NO_MEMORY : FADEV_ERR_CUDA;
}

fadev_status fadev_cuda_fail_msg(fadev_status st, const char *message) {
    snprintf(last_error, sizeof last_error, "%s", message);
    return st;
}

/* How much of the current device's default memory pool (device_buffer's allocations) stays reserved between
 * calls: 4 GiB, or FADEV_CUDA_POOL_BYTES; set once per device. Beyond it, freed memory goes back to the driver at
 * the next synchronisation. */
static void keep_pool(void) {
    static int done[64];
    int device = 0, pools = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 64 || done[device]) return;
    done[device] = 1;
    if (cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess || !pools) return;
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess) return;
    const char *text = getenv("FADEV_CUDA_POOL_BYTES");
    unsigned long long keep = text && *text ? strtoull(text, NULL, 10) : 4ull << 30;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    cudaGetLastError();
}

/* FADEV_CUDA_SCRATCH_BYTES (tests: small problems chunked as large ones are), 0 where unset */
static size_t scratch_cap() {
    const char *text = getenv("FADEV_CUDA_SCRATCH_BYTES");
    return text ? (size_t)strtoull(text, NULL, 10) : 0;
}

fadev_status fadev_cuda_scratch_budget(size_t *budget) {
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_TRY(cudaMemGetInfo(&free_bytes, &total_bytes));
    *budget = free_bytes / 3 < ((size_t)2 << 30) ? free_bytes / 3 : ((size_t)2 << 30);
    const size_t cap = scratch_cap();
    if (cap > 0 && cap < *budget) *budget = cap;
    return FADEV_OK;
}

/* Values of a device that do not change while the process runs, read from the driver once a device: the emulated
 * and native calls asked for them on every call (issue 24: the host's time of a call). Kept as value + 1; 0: not
 * read yet. */
namespace {
constexpr int MAX_DEVICES = 64;
std::atomic<int> sm_counts[MAX_DEVICES], smem_optins[MAX_DEVICES], pool_support[MAX_DEVICES], cc_major[MAX_DEVICES],
    cc_minor[MAX_DEVICES];

fadev_status device_value(std::atomic<int> *cache, cudaDeviceAttr attr, int *value) {
    int device = 0;
    CUDA_TRY(cudaGetDevice(&device));
    const bool kept = device >= 0 && device < MAX_DEVICES;
    const int have = kept ? cache[device].load(std::memory_order_relaxed) : 0;
    if (have > 0) return *value = have - 1, FADEV_OK;
    CUDA_TRY(cudaDeviceGetAttribute(value, attr, device));
    if (kept) cache[device].store(*value + 1, std::memory_order_relaxed);
    return FADEV_OK;
}
} // namespace

fadev_status fadev_cuda_scratch_fits(size_t bytes, int *fits) {
    *fits = 0;
    const size_t cap = scratch_cap();
    if (bytes > ((size_t)2 << 30) || (cap > 0 && bytes > cap)) return FADEV_OK;
    int device = 0, pools = 0;
    CUDA_TRY(cudaGetDevice(&device));
    FADEV_TRY(device_value(pool_support, cudaDevAttrMemoryPoolsSupported, &pools));
    if (pools && device >= 0 && device < MAX_DEVICES) { /* memory the pool holds and no allocation uses: taking it
                                                         * takes nothing from anyone */
        static cudaMemPool_t default_pools[MAX_DEVICES]; /* read once a device (call_once orders it for every thread) */
        static std::once_flag once[MAX_DEVICES];
        std::call_once(once[device], [device] {
            if (cudaDeviceGetDefaultMemPool(&default_pools[device], device) != cudaSuccess)
                default_pools[device] = nullptr, cudaGetLastError();
        });
        unsigned long long reserved = 0, used = 0; /* the attributes are cuuint64_t */
        if (default_pools[device]) {
            CUDA_TRY(cudaMemPoolGetAttribute(default_pools[device], cudaMemPoolAttrReservedMemCurrent, &reserved));
            CUDA_TRY(cudaMemPoolGetAttribute(default_pools[device], cudaMemPoolAttrUsedMemCurrent, &used));
        }
        if (reserved >= used && reserved - used >= bytes) return *fits = 1, FADEV_OK;
    }
    size_t budget = 0;
    FADEV_TRY(fadev_cuda_scratch_budget(&budget));
    *fits = bytes <= budget;
    return FADEV_OK;
}

fadev_status fadev_cuda_sm_count(int *sms) { return device_value(sm_counts, cudaDevAttrMultiProcessorCount, sms); }

fadev_status fadev_cuda_smem_optin(int *bytes) {
    return device_value(smem_optins, cudaDevAttrMaxSharedMemoryPerBlockOptin, bytes);
}

fadev_status fadev_cuda_capability(int *major, int *minor) {
    FADEV_TRY(device_value(cc_major, cudaDevAttrComputeCapabilityMajor, major));
    return device_value(cc_minor, cudaDevAttrComputeCapabilityMinor, minor);
}

fadev_status fadev_cuda_smem_attr(const void *kernel, int bytes) {
    /* (kernel, device) -> the size set: set once a device, again only to grow it */
    static std::mutex mu;
    static std::map<std::pair<const void *, int>, int> set;
    int device = 0;
    CUDA_TRY(cudaGetDevice(&device));
    std::lock_guard<std::mutex> hold(mu);
    int &have = set[{kernel, device}];
    if (have >= bytes) return FADEV_OK;
    CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    have = bytes;
    return FADEV_OK;
}

fadev_status fadev_cuda_require_device(void) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err == cudaSuccess && count > 0) {
        keep_pool();
        return FADEV_OK;
    }
    char message[256];
    /* no driver, a driver too old for this runtime, no device: CUDA's own words say which */
    snprintf(message, sizeof message, "fadev was built with CUDA, but no CUDA device was found (cudaGetDeviceCount: %s)",
             err == cudaSuccess ? "0 devices" : cudaGetErrorString(err));
    cudaGetLastError();
    return fadev_cuda_fail_msg(FADEV_ERR_NO_CUDA, message);
}

fadev_status fadev_cuda_finish(const char *where) {
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    return err == cudaSuccess ? FADEV_OK : fadev_cuda_fail(err, where);
}

fadev_status fadev_cuda_end(int asynchronous, const char *where) {
    if (!asynchronous) return fadev_cuda_finish(where);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? FADEV_OK : fadev_cuda_fail(err, where);
}

extern "C" const char *fadev_cuda_last_error(void) { return last_error; }

extern "C" int fadev_cuda_compiled(void) { return 1; }

extern "C" int fadev_cuda_device_count(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError(); /* clear the sticky "no driver" error */
        return 0;
    }
    return count;
}

extern "C" fadev_status fadev_cuda_device_info(int device, char *name, size_t name_len, int *major, int *minor,
                                               size_t *total_memory) {
    cudaDeviceProp prop;
    CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    snprintf(name, name_len, "%s", prop.name);
    *major = prop.major;
    *minor = prop.minor;
    *total_memory = prop.totalGlobalMem;
    return FADEV_OK;
}

__global__ void round_kernel(const double *x, double *out, size_t n, fadev_format fmt, int mode, uint64_t seed,
                             uint64_t stream, uint64_t index_offset) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t r = mode == FADEV_ROUND_STOCHASTIC ? fadev_random53(seed, stream, index_offset + i) : 0;
        out[i] = fadev_round_one(x[i], &fmt, mode, r);
    }
}

extern "C" fadev_status fadev_cuda_round_f64(const double *x, double *out, size_t n, const fadev_format *fmt,
                                             int mode, uint64_t seed, uint64_t stream, uint64_t index_offset) {
    if (mode < FADEV_ROUND_NEAREST_EVEN || mode > FADEV_ROUND_STOCHASTIC) return FADEV_ERR_INVALID_MODE;
    FADEV_TRY(fadev_cuda_require_device());
    if (n == 0) return FADEV_OK;
    double *d_buf = NULL;
    CUDA_TRY(cudaMalloc(&d_buf, n * sizeof(double)));
    fadev_status st = FADEV_OK;
    cudaError_t err = cudaMemcpy(d_buf, x, n * sizeof(double), cudaMemcpyHostToDevice);
    if (err == cudaSuccess) {
        size_t blocks = (n + 255) / 256;
        if (blocks > 65535) blocks = 65535;
        round_kernel<<<(unsigned)blocks, 256>>>(d_buf, d_buf, n, *fmt, mode, seed, stream, index_offset);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess) err = cudaMemcpy(out, d_buf, n * sizeof(double), cudaMemcpyDeviceToHost);
    if (err != cudaSuccess) st = fadev_cuda_fail(err, "fadev_cuda_round_f64");
    cudaFree(d_buf);
    return st;
}
