/* Device memory for the Python layer (fadev/cuda.py's DeviceArray and its interop checks).
 *
 *   fadev_cuda_malloc(&ptr, bytes)            cudaMalloc; a 0-byte request gets 1 byte, so a pointer is never NULL
 *   fadev_cuda_free(ptr)                      cudaFree; NULL is a no-op
 *   fadev_cuda_memcpy(dst, src, bytes, kind)  kind 0 host->device, 1 device->host, 2 device->device, on the
 *                                             legacy default stream; 0 bytes copies nothing
 *   fadev_cuda_pointer_device(ptr, &device)   the device owning ptr, -1 for host (or unregistered) memory
 *
 * Like every entry point they synchronise the device before returning (so a 0-byte copy is a device-wide
 * barrier, which the binding's cuda_synchronize uses) and report a CUDA error as FADEV_ERR_CUDA with its
 * message (fadev_cuda_last_error); cudaErrorMemoryAllocation's name in that message is what makes the
 * binding raise MemoryError. */
#include "common.cuh"

extern "C" fadev_status fadev_cuda_malloc(void **ptr, size_t bytes) {
    if (!ptr) return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_malloc: ptr is NULL");
    *ptr = NULL;
    FADEV_TRY(fadev_cuda_require_device());
    void *p = NULL;
    CUDA_TRY(cudaMalloc(&p, bytes == 0 ? 1 : bytes));
    fadev_status st = fadev_cuda_finish("fadev_cuda_malloc");
    if (st != FADEV_OK) {
        cudaFree(p);
        return st;
    }
    *ptr = p;
    return FADEV_OK;
}

extern "C" fadev_status fadev_cuda_free(void *ptr) {
    if (!ptr) return FADEV_OK;
    FADEV_TRY(fadev_cuda_require_device());
    CUDA_TRY(cudaFree(ptr));
    return fadev_cuda_finish("fadev_cuda_free");
}

extern "C" fadev_status fadev_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind) {
    static const cudaMemcpyKind kinds[3] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                            cudaMemcpyDeviceToDevice};
    if (kind < 0 || kind > 2)
        return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_memcpy: kind must be 0, 1 or 2");
    if (bytes > 0 && (!dst || !src))
        return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_memcpy: a NULL pointer");
    FADEV_TRY(fadev_cuda_require_device());
    if (bytes > 0) CUDA_TRY(cudaMemcpy(dst, src, bytes, kinds[kind]));
    return fadev_cuda_finish("fadev_cuda_memcpy");
}

extern "C" fadev_status fadev_cuda_current_device(int *device) {
    if (!device) return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_current_device: device is NULL");
    CUDA_TRY(cudaGetDevice(device));
    return FADEV_OK;
}

extern "C" fadev_status fadev_cuda_pointer_device(const void *ptr, int *device) {
    if (!device) return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "fadev_cuda_pointer_device: device is NULL");
    *device = -1;
    FADEV_TRY(fadev_cuda_require_device());
    if (!ptr) return FADEV_OK;
    cudaPointerAttributes attr;
    CUDA_TRY(cudaPointerGetAttributes(&attr, ptr));
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) *device = attr.device;
    return FADEV_OK;
}
