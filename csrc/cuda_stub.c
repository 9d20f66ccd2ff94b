/* CUDA entry points for a CPU-only build (no nvcc): they report that CUDA is absent.
 * A build with nvcc defines FADEV_WITH_CUDA and takes these from cuda/ instead. */
#include "fadev.h"

/* the stubs read none of their arguments */
#pragma GCC diagnostic ignored "-Wunused-parameter"

#ifndef FADEV_WITH_CUDA
int fadev_cuda_compiled(void) { return 0; }

int fadev_cuda_device_count(void) { return 0; }

fadev_status fadev_cuda_device_info(int device, char *name, size_t name_len, int *major, int *minor,
                                    size_t *total_memory) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_round_f64(const double *x, double *out, size_t n, const fadev_format *fmt, int mode,
                                  uint64_t seed, uint64_t stream, uint64_t index_offset) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_current_device(int *device) { return FADEV_ERR_NO_CUDA; }

const char *fadev_cuda_last_error(void) { return "fadev was built without CUDA"; }

fadev_status fadev_cuda_malloc(void **ptr, size_t bytes) {
    if (ptr) *ptr = NULL;
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_free(void *ptr) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_pointer_device(const void *ptr, int *device) {
    if (device) *device = -1;
    return FADEV_ERR_NO_CUDA;
}

/* the parameter lists of fadev.h's emulated attention entry points */
#define FORWARD_ARGS                                                                                          \
    const double *q, const double *k, const double *v, double *out, double *lse, const fadev_attention_params *params, \
        const fadev_policy *policy
#define BACKWARD_ARGS                                                                                       \
    const double *q, const double *k, const double *v, const double *out, const double *lse, const double *dout, \
        double *dq, double *dk, double *dv, const fadev_attention_params *params, const fadev_policy *policy,     \
        const fadev_policy_backward *policy_backward

fadev_status fadev_cuda_baseline_attention(FORWARD_ARGS) { return FADEV_ERR_NO_CUDA; }

fadev_status fadev_cuda_flash_attention(FORWARD_ARGS) { return FADEV_ERR_NO_CUDA; }

fadev_status fadev_cuda_baseline_attention_backward(BACKWARD_ARGS) { return FADEV_ERR_NO_CUDA; }

fadev_status fadev_cuda_flash_attention_backward(BACKWARD_ARGS) { return FADEV_ERR_NO_CUDA; }

fadev_status fadev_cuda_golden_attention(const double *q, const double *k, const double *v, double *out, double *lse,
                                         const fadev_attention_params *params) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_deviation_stats(const double *test, const double *ref, size_t n, fadev_deviation *out) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_wasserstein(const double *a, size_t n_a, const double *b, size_t n_b, double *out) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_ulp_error(const double *test, const double *ref, size_t n, const fadev_format *fmt,
                                  double *out) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_exp_check(int exp2_form, int ref_form, uint64_t start, uint64_t count, uint64_t *mismatches) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_exp_table_check(int bf16, int exp2_form, int ref_form, uint64_t *mismatches, int *lo, int *hi) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_quot_check(int bf16, int naive, uint64_t *mismatches, uint64_t *pairs) {
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_round_check(int bf16, int naive, uint64_t *mismatches) { return FADEV_ERR_NO_CUDA; }

fadev_status fadev_cuda_native_tiles(int dim, int backward, int warp_rows, int mma, int32_t *tiles, int max_pairs,
                                     int *count) {
    if (count) *count = 0;
    return FADEV_ERR_NO_CUDA;
}

fadev_status fadev_cuda_native_forward(const void *q, const void *k, const void *v, void *out, float *lse,
                                       const fadev_native_params *params) {
    return FADEV_ERR_NO_CUDA;
}

size_t fadev_cuda_native_workspace(const fadev_native_params *params) {
    return 0;
}

fadev_status fadev_cuda_native_backward(const void *q, const void *k, const void *v, const void *out,
                                        const float *lse, const void *dout, void *dq, void *dk, void *dv,
                                        float *workspace, const fadev_native_params *params) {
    return FADEV_ERR_NO_CUDA;
}
#endif
