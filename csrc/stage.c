/* Stages, rounding events and the checks every attention entry point shares (stage.h): the CPU kernels
 * (att_validate), the GPU's emulated kernels, golden.cu and the native tensor-core kernels. */
#include <float.h>
#include <math.h>
#include <string.h>

#include "stage.h"

/* ------------------------------------------------------------------ formats and stages */

int att_valid_format(const fadev_format *f) {
    fadev_format check;
    if (!(f->largest > 0)) return 0;
    if (fadev_format_make(f->precision, f->emin, f->emax, f->subnormals, f->has_inf, f->overflow, f->largest,
                          &check) != FADEV_OK)
        return 0;
    return check.subnormals == f->subnormals && check.has_inf == f->has_inf;
}

static int is_fp64(const fadev_format *f) {
    return f->precision == 53 && f->emin == -1022 && f->emax == 1023 && f->subnormals && f->has_inf &&
           f->largest == DBL_MAX;
}

static int is_fp32(const fadev_format *f) {
    return f->precision == 24 && f->emin == -126 && f->emax == 127 && f->subnormals && f->has_inf &&
           f->overflow == FADEV_OVERFLOW_INF && f->largest == (double)FLT_MAX;
}

int att_inside_fp32(const fadev_format *f) {
    int lowest = f->subnormals ? f->emin - f->precision + 1 : f->emin;
    return f->precision <= 24 && f->emin >= -126 && f->largest <= (double)FLT_MAX && lowest >= -149;
}

double att_round_slow(const att_stage *st, double x, uint64_t stream, uint64_t index) {
    return att_round_general(st, x, stream, index);
}

att_stage att_make_stage(const fadev_format *f, const fadev_policy *pol) {
    att_stage st;
    st.fmt = *f;
    st.mode = pol->rounding;
    st.seed = pol->seed;
    int rne = pol->rounding == FADEV_ROUND_NEAREST_EVEN;
    st.kind = is_fp64(f)                          ? ATT_EXACT
              : (is_fp32(f) && rne)                 ? ATT_F32
              : (rne && f->precision < 53)          ? ATT_RNE
                                                    : ATT_GENERAL;
    st.shift = 53 - f->precision;
    st.lo_bits = fadev_bits_of(ldexp(1.0, f->emin));
    st.hi_bits = fadev_bits_of(f->largest);
    st.half_m1 = st.shift ? (1ull << (st.shift - 1)) - 1 : 0;
    st.keep_mask = ~((1ull << st.shift) - 1);
    return st;
}

/* The policy's 13 formats, in the order of att_plan's stages (input .. out). */
#define POLICY_FORMATS(pol)                                                                                \
    {&(pol)->input, &(pol)->score_acc, &(pol)->score, &(pol)->softmax, &(pol)->sum_acc, &(pol)->stats,     \
     &(pol)->rescale, &(pol)->p, &(pol)->pv_acc, &(pol)->out_acc, &(pol)->state_out, &(pol)->state_stats, \
     &(pol)->out}

void att_plan_init(att_plan *plan, const fadev_attention_params *params, const fadev_policy *pol, int exp2_form) {
    memset(plan, 0, sizeof *plan);
    plan->pr = *params;
    plan->group = params->heads / params->heads_kv;
    const fadev_format *fmts[] = POLICY_FORMATS(pol);
    att_stage *stages[] = {&plan->input, &plan->score_acc, &plan->score, &plan->softmax, &plan->sum_acc,
                           &plan->stats, &plan->rescale, &plan->p, &plan->pv_acc, &plan->out_acc,
                           &plan->state_out, &plan->state_stats, &plan->out};
    for (size_t s = 0; s < sizeof fmts / sizeof fmts[0]; s++) *stages[s] = att_make_stage(fmts[s], pol);
    plan->exp2 = exp2_form;
    /* constants: rounded once to nearest even (log2 e and ln 2 are the fp64 constants M_LOG2E, M_LN2) */
    double log2e = 0x1.71547652b82fep+0, ln2 = 0x1.62e42fefa39efp-1;
    plan->c = fadev_round_one(exp2_form ? params->scale * log2e : params->scale, &pol->score,
                              FADEV_ROUND_NEAREST_EVEN, 0);
    plan->c2 = fadev_round_one(ln2, &pol->stats, FADEV_ROUND_NEAREST_EVEN, 0);
    const fadev_format *in = &pol->input;
    plan->qk_float = plan->score_acc.kind == ATT_F32 && att_inside_fp32(in) && 2 * in->precision <= 24;
    plan->pv_float = plan->pv_acc.kind == ATT_F32 && att_inside_fp32(in) && att_inside_fp32(&pol->p) &&
                     in->precision + pol->p.precision <= 24;
}

/* ------------------------------------------------------------------ validation */

#define CHECK(cond, status, message) \
    do {                             \
        if (!(cond)) {               \
            if (why) *why = message; \
            return status;           \
        }                            \
    } while (0)

fadev_status att_check_params(const fadev_attention_params *pr, int max_dim, int flash, const char **why) {
    CHECK(pr, FADEV_ERR_INVALID_ARGUMENT, "params is NULL");
    CHECK(pr->batch >= 1 && pr->heads >= 1 && pr->heads_kv >= 1 && pr->seq_q >= 1 && pr->seq_kv >= 1,
          FADEV_ERR_INVALID_ARGUMENT, "batch, heads, heads_kv, seq_q, seq_kv must be >= 1");
    CHECK(pr->dim >= 1 && pr->dim <= max_dim, FADEV_ERR_INVALID_ARGUMENT, "dim out of range");
    CHECK(pr->heads % pr->heads_kv == 0, FADEV_ERR_SHAPE, "heads must be a multiple of heads_kv");
    CHECK(isfinite(pr->scale), FADEV_ERR_INVALID_ARGUMENT, "scale must be finite");
    CHECK(pr->causal == 0 || pr->causal == 1, FADEV_ERR_INVALID_ARGUMENT, "causal must be 0 or 1");
    if (flash) {
        CHECK(pr->block_q >= 1 && pr->block_kv >= 1, FADEV_ERR_INVALID_ARGUMENT, "block_q, block_kv must be >= 1");
        CHECK(pr->loop_order == FADEV_Q_OUTER || pr->loop_order == FADEV_KV_OUTER, FADEV_ERR_INVALID_ARGUMENT,
              "loop_order out of range");
        CHECK(pr->normalize == FADEV_DEFERRED || pr->normalize == FADEV_EAGER, FADEV_ERR_INVALID_ARGUMENT,
              "normalize out of range");
        CHECK(pr->exp_form == FADEV_EXP || pr->exp_form == FADEV_EXP2, FADEV_ERR_INVALID_ARGUMENT,
              "exp_form out of range");
    }
    return FADEV_OK;
}

fadev_status att_check_policy(const fadev_policy *pol, const fadev_attention_params *pr) {
    if (!pol) return FADEV_ERR_INVALID_ARGUMENT;
    if (pol->rounding != FADEV_ROUND_NEAREST_EVEN && pol->rounding != FADEV_ROUND_TOWARD_ZERO &&
        pol->rounding != FADEV_ROUND_STOCHASTIC)
        return FADEV_ERR_INVALID_MODE;
    const fadev_format *fmts[] = POLICY_FORMATS(pol);
    for (size_t s = 0; s < sizeof fmts / sizeof fmts[0]; s++)
        if (!att_valid_format(fmts[s])) return FADEV_ERR_INVALID_FORMAT;
    /* the stochastic counter packs (i, u, w) into 21-bit fields */
    if (pol->rounding == FADEV_ROUND_STOCHASTIC && (pr->seq_q >= (1 << 21) || pr->seq_kv >= (1 << 21)))
        return FADEV_ERR_INVALID_ARGUMENT;
    return FADEV_OK;
}
