/* The warp forward's baseline kernels with the stage kinds read at run time (emu_forward_warp_tile.cuh), lean and
 * not, D <= 64 and D <= 128, with and without the causal mask, with and without the score store: two thirds of the
 * run-time kinds' kernels, in a file of their own so that nvcc compiles them beside the flash kernels
 * (emu_forward_warp.cu): the longest compile of the build, 130 s for both, is 78 s so (sm_90, nvcc 13.0, the 2-core
 * dev box, 2026-11-28). */
#include "emu_forward_warp_grid.cuh"

namespace emu_warp {

namespace {

/* with or without the score store (a kernel each: the store's branches in the recomputing kernel cost it registers) */
template <int DC, bool LEAN, bool CAUSAL>
fadev_status launch_keep(const fast_args &a, int64_t ctas) {
    return a.s_keep ? launch<DC, LEAN, true, CAUSAL, true>(a, ctas) : launch<DC, LEAN, true, CAUSAL, false>(a, ctas);
}

template <int DC, bool LEAN>
fadev_status launch_mask(const fast_args &a, int64_t ctas) {
    return a.cx.pr.causal ? launch_keep<DC, LEAN, true>(a, ctas) : launch_keep<DC, LEAN, false>(a, ctas);
}

} // namespace

fadev_status launch_base(const fast_args &a, int64_t ctas) {
    if (a.cx.pr.dim <= 64) return a.lean ? launch_mask<2, true>(a, ctas) : launch_mask<2, false>(a, ctas);
    return a.lean ? launch_mask<4, true>(a, ctas) : launch_mask<4, false>(a, ctas);
}

} // namespace emu_warp
