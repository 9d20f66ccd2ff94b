/* The native forward's head dim 128 instances (native_forward.cuh), compiled apart from native_forward.cu's D 64 so
 * that the two compile side by side. */
#include "native_forward.cuh"

fadev_status native_forward_d128(const fadev_native_params *p, const native_fwd_args &a, int64_t ctas) {
    return p->dtype == FADEV_NATIVE_FP16 ? native_forward_dim<__half, 128>(p, a, ctas)
                                         : native_forward_dim<__nv_bfloat16, 128>(p, a, ctas);
}
