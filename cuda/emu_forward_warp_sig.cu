/* The warp forward's flash kernels compiled for the presets' stage kinds (SIGS, emu_forward_warp.cuh: fa2's and the
 * paper's, bf16 and fp16): D <= 64 causal, and D <= 128 with and without the mask (warp_sig: where they measured
 * faster). A file of their own, so that nvcc compiles them beside the run-time kinds' kernels (emu_forward_warp.cu). */
#include "emu_forward_warp_tile.cuh"

namespace emu_warp {

namespace {

template <int SIG> fadev_status launch_one(const fast_args &a, int64_t ctas) {
    const bool causal = a.cx.pr.causal;
    if (a.cx.pr.dim <= 64) {
        if (!causal) return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "emulated attention: no such kernel");
        return launch<2, true, false, true, false, SIG>(a, ctas);
    }
    return causal ? launch<4, true, false, true, false, SIG>(a, ctas) : launch<4, true, false, false, false, SIG>(a, ctas);
}

template <int S> fadev_status launch_from(const fast_args &a, int64_t ctas, int sig) {
    if constexpr (S > N_SIGS) {
        return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "emulated attention: no kernel for these stage kinds");
    } else {
        return sig == S ? launch_one<S>(a, ctas) : launch_from<S + 1>(a, ctas, sig);
    }
}

} // namespace

fadev_status launch_sig(const fast_args &a, int64_t ctas, int sig) { return launch_from<1>(a, ctas, sig); }

} // namespace emu_warp
