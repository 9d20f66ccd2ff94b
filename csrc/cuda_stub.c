/* CUDA entry points for a CPU-only build (no nvcc): they report that CUDA is absent.
 * A build with nvcc defines FADEV_WITH_CUDA and takes these from cuda/ instead. */
#include "fadev.h"

#ifndef FADEV_WITH_CUDA
int fadev_cuda_compiled(void) { return 0; }

int fadev_cuda_device_count(void) { return 0; }

fadev_status fadev_cuda_device_info(int device, char *name, size_t name_len, int *major, int *minor,
                                    size_t *total_memory) {
    (void)device, (void)name, (void)name_len, (void)major, (void)minor, (void)total_memory;
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_round_f64(const double *x, double *out, size_t n, const fadev_format *fmt, int mode,
                                  uint64_t seed, uint64_t stream, uint64_t index_offset) {
    (void)x, (void)out, (void)n, (void)fmt, (void)mode, (void)seed, (void)stream, (void)index_offset;
    return FADEV_ERR_NO_CUDA;
}

const char *fadev_cuda_last_error(void) { return "fadev was built without CUDA"; }
#endif
