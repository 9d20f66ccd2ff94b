/* The warp forward's kernels compiled for the presets' stage kinds (SIGS, emu_forward_warp.cuh; bf16 and fp16): fa2's
 * and paper's flash kernels at D <= 64 causal and at D <= 128 with and without the mask (warp_sig: where they
 * measured faster), naive's baseline kernels (with the score store) at both. A file of their own, so that nvcc compiles them beside the run-time kinds' kernels (emu_forward_warp.cu). */
#include "emu_forward_warp_grid.cuh"

namespace emu_warp {

namespace {

template <int SIG> fadev_status launch_one(const fast_args &a, int64_t ctas) {
    const bool causal = a.cx.pr.causal;
    if constexpr (sig_at<SIG, SG_BASE>()) { /* with the score store (warp_sig) */
        if (a.cx.pr.dim <= 64)
            return causal ? launch<2, true, true, true, true, SIG>(a, ctas)
                          : launch<2, true, true, false, true, SIG>(a, ctas);
        return causal ? launch<4, true, true, true, true, SIG>(a, ctas) : launch<4, true, true, false, true, SIG>(a, ctas);
    }
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
