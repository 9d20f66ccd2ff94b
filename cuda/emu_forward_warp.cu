/* The emulated forward's warp kernels (emu_forward_warp_tile.cuh): the flash kernels' launch for the policies whose
 * stage kinds are read at run time (emu_forward_warp_base.cu launches the baseline's, emu_forward_warp_sig.cu the
 * presets', compiled for their kinds), the baseline's score store, and the host's choice among them. */
#include <stdlib.h>
#include <string.h>

#include "emu_forward_warp_grid.cuh"

using namespace emu_fwd;
using namespace emu_warp;

namespace {

template <int DC, bool LEAN>
fadev_status launch_flash(const fast_args &a, int64_t ctas) {
    return a.cx.pr.causal ? launch<DC, LEAN, false, true>(a, ctas) : launch<DC, LEAN, false, false>(a, ctas);
}

} // namespace

int emu_warp::warp_sig(const fast_args &a) {
    const emu_ctx &cx = a.cx;
    const char *off = getenv("FADEV_EMU_SIG");
    if ((off && strcmp(off, "0") == 0) || !a.lean || cx.sum_acc.kind != ATT_F32) return 0;
    if (a.baseline && !a.s_keep) return 0;
    if (!a.baseline && (cx.pr.normalize == FADEV_EAGER || cx.pr.loop_order == FADEV_KV_OUTER)) return 0;
    if (!a.baseline && cx.pr.dim <= 64 && !cx.pr.causal) return 0; /* the run-time kinds' kernel measured faster
                                                                    * there (H100, paper's forward 3% at D 64; fa2's
                                                                    * within 0.4%), and slower in every other (causal,
                                                                    * D 128: fa2 0.4-2.6%, paper 1-2.8%) */
    const int oform = a.baseline ? 0 : a.o32 ? O_F32 : a.o16 ? O_N16 + a.o16 : -1; /* with_o_form's */
    for (int s = 0; s < N_SIGS; s++) {
        const int *g = SIGS[s];
        if (g[SG_BASE] == a.baseline && flt_kind_at(a.lean, LK_SCORE) == g[SG_SCORE] &&
            flt_kind_at(a.lean, LK_SOFTMAX) == g[SG_SOFT] && a.p_kind == g[SG_P] && oform == g[SG_OFORM] &&
            cx.exp2 == g[SG_EXP2])
            return s + 1;
    }
    return 0;
}

int emu_fwd::warp_forward_ok(const emu_ctx &cx, int baseline) {
    const char *off = getenv("FADEV_EMU_WARP"); /* tests and benchmarks: 0 runs emu_forward_fast.cu's kernel */
    if (off && strcmp(off, "0") == 0) return 0;
    const int64_t bkv = cx.pr.block_kv < cx.pr.seq_kv ? cx.pr.block_kv : cx.pr.seq_kv;
    return (baseline || bkv <= KB) && cx.pr.dim <= 128;
}

/* The baseline's grid and score store: every resident CTA (2 an SM) a slot of BQ x Nk fp32 scores, where they fit
 * in the scratch budget (fadev_cuda_scratch_fits: min(2 GiB, a third of the free memory), FADEV_CUDA_SCRATCH_BYTES;
 * or memory the pool holds unused, as it holds the last call's store), FADEV_EMU_KEEP=0 turns
 * the store off -- else a CTA per unit, every pass computing the scores. Storing them saves two of the baseline's
 * four product chains a score (2 D FMAs; the first pass's maxima need every score before any term) for 12 bytes of
 * memory traffic a score (one store, two loads). */
static fadev_status keep_plan(fast_args &a, int64_t bq, device_buffer<float> &keep, int64_t &grid) {
    grid = a.units;
    const char *off = getenv("FADEV_EMU_KEEP");
    if (!a.baseline || (off && strcmp(off, "0") == 0)) return FADEV_OK;
    int sms = 0;
    FADEV_TRY(fadev_cuda_sm_count(&sms));
    const int64_t slots = a.units < 2 * (int64_t)sms ? a.units : 2 * (int64_t)sms;
    const int64_t per = bq * ((a.cx.pr.seq_kv + KB - 1) / KB) * KB; /* floats a slot */
    int fits = 0;
    FADEV_TRY(fadev_cuda_scratch_fits((size_t)(slots * per) * sizeof(float), &fits));
    if (!fits) return FADEV_OK;
    FADEV_TRY(keep.alloc((size_t)(slots * per), "emulated baseline attention: scores"));
    a.s_keep = keep.ptr, grid = slots;
    return FADEV_OK;
}

fadev_status emu_fwd::warp_forward(const emu_ctx &cx, double *out, double *lse, int baseline) {
    const int d64 = cx.pr.dim <= 64;
    const int64_t bq = d64 ? tile<2>::BQ : tile<4>::BQ;
    fast_args a = fast_args_of(cx, out, lse, baseline, (int)bq);
    /* the causal baseline's units (emu_forward_warp_grid.cuh): where they fill the resident slots (2 CTAs an SM)
     * with at most an eighth idle, the shifted pairs (units of T tile-lengths) if they end in one round, else the
     * end pairs (T + 1) if they fit in one; otherwise single tiles. At B 1, H 16, N 4096, D 64 on 132 SMs: 256 units
     * of T and 16 middles of T / 2 on 264 slots, where the end pairs were 256 of T + 1 */
    const int64_t heads = cx.pr.batch * cx.pr.heads, T = a.tiles;
    a.units = heads * T;
    if (baseline && cx.pr.causal && T > 1) {
        int sms = 0;
        FADEV_TRY(fadev_cuda_sm_count(&sms));
        const int64_t slots = 2 * (int64_t)sms, full = heads * (1 + (T - 1) / 2), mid = (T - 1) % 2 ? heads : 0;
        const int64_t ends = heads * ((T + 1) / 2);
        if (full + (mid + 1) / 2 <= slots && 8 * (full + mid) >= 7 * slots) a.pairing = PAIR_SHIFTED, a.units = full + mid;
        else if (ends <= slots && 8 * ends >= 7 * slots) a.pairing = PAIR_ENDS, a.units = ends;
    }
    if (a.units >= (int64_t)1 << 31) return fadev_cuda_fail_msg(FADEV_ERR_INVALID_ARGUMENT, "emulated attention: grid too large");
    device_buffer<float> keep;
    int64_t ctas = 0;
    FADEV_TRY(keep_plan(a, bq, keep, ctas));
    if (a.lean) FADEV_TRY(exp_table_of(flt_kind_at(a.lean, LK_SOFTMAX), cx.exp2, a.etab));
    if (const int sig = warp_sig(a)) return launch_sig(a, ctas, sig);
    if (baseline) return launch_base(a, ctas);
    if (d64) return a.lean ? launch_flash<2, true>(a, ctas) : launch_flash<2, false>(a, ctas);
    return a.lean ? launch_flash<4, true>(a, ctas) : launch_flash<4, false>(a, ctas);
}
