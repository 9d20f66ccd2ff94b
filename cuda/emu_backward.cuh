/* What the emulated backward's kernels share (emu_backward.cu: the generic schedule; emu_backward_fast.cu: the
 * register-blocked fp32 FMA sums): the events, the arguments of one call, the virtual rows. */
#ifndef FADEV_EMU_BACKWARD_CUH
#define FADEV_EMU_BACKWARD_CUH

#include "emu.cuh"

/* Backward events (csrc/backward.h's bwd_event; that header is C11-only): stream 2^48 + id + 32 bh. */
enum bwd_event {
    EV_DOUT = 0, EV_OUT = 1, EV_LSE = 2, EV_LSE_LOG2 = 3, EV_DELTA_ACC = 4, EV_DELTA = 5, EV_BWD_P = 6,
    EV_DP_ACC = 7, EV_DP = 8, EV_DSOFT_SUB = 9, EV_DSOFT_MUL = 10, EV_DS = 11, EV_ACC_DV = 12, EV_ACC_DK = 13,
    EV_ACC_DQ = 14, EV_DKV_DV = 15, EV_DKV_DK = 16, EV_DQ_ACC = 17, EV_GRAD_DQ = 18, EV_GRAD_DK = 19,
    EV_GRAD_DV = 20, EV_DSOFT_P = 21, EV_DSOFT_SCALE = 22
};

__host__ __device__ __forceinline__ uint64_t bwd_stream(int id, int64_t bh) {
    return (1ull << 48) + (uint64_t)id + 32u * (uint64_t)bh;
}

struct bwd_args {
    emu_ctx cx; /* forward stages and constants, rounded q, k, v, K/V magnitudes */
    att_stage bwd_p, dsoft_p, dp_acc, dp, delta_acc, dsoft, ds, grad_acc, dq_acc, dkv_acc, grad;
    int baseline;
    int ds_scaled;             /* the scale multiplies each dS (c_ds) before R_ds; c_grad is then 1 */
    int dp_float;              /* the float tier is possible for dP (policy); the data decide per (b, g) */
    int dq_acc_kind, dkv_acc_kind; /* their flt_kinds (the fast sums' flushes) */
    double c_grad, c_ds, c3;   /* the dQ, dK sums' scale (R_score(scale) or 1), R_score(scale), R_stats(log2 e) */
    int64_t block_q, block_kv; /* logical blocks (baseline: Nq, Nk) */
    int64_t chunk_rows;        /* row capacity of the scratch per K/V head */
    int64_t g0, r0, rn;        /* this chunk: K/V heads g0.., virtual rows [r0, r0 + rn) */
    const double *out_in, *lse_in, *dout_in; /* the caller's */
    double *dout;                            /* R_input(dout) */
    float *doutf;                            /* the same as fp32 for the fast sums, or null */
    double *row_l, *row_d;                   /* flash: L_i and D_i per query row */
    unsigned *row_max;                       /* the baseline's fast rows: max_j s_j per query row (max_key), or null */
    emu_mag *qmag, *domag;                   /* per K/V head: magnitudes of its group's Q and dO */
    double *sa, *sb;                         /* scratch [g - g0][r - r0][j]: P' (baseline: s first), dS (dP) */
    float *saf, *sbf;                        /* the same scratch as fp32 values (fast pair kernel), or null */
    double *dk_part, *dv_part;               /* running grad_acc sums of dK, dV (B, Hkv, Nk, D) */
    double *dq, *dk, *dv;                    /* outputs; dk, dv hold dKacc, dVacc until the last chunk */
};

struct vrow {
    int64_t bh, i;
};

/* Query head and row of virtual row r of K/V head bg. */
__device__ __forceinline__ vrow vrow_of(const bwd_args &a, int64_t bg, int64_t r) {
    const fadev_attention_params &pr = a.cx.pr;
    const int64_t hh = r / pr.seq_q, b = bg / pr.heads_kv, g = bg % pr.heads_kv;
    return {b * pr.heads + g * a.cx.group + hh, r - hh * pr.seq_q};
}

/* Last key query row i sees (bottom-right causal mask); < 0: none. */
__device__ __forceinline__ int64_t last_key(const fadev_attention_params &pr, int64_t i) {
    return pr.causal ? i + pr.seq_kv - pr.seq_q : pr.seq_kv - 1;
}

/* The fast kernels' tiles (emu_backward_fast.cu, emu_backward_pairs.cu): TM rows (or keys) x TN columns or keys a
 * CTA of NT threads, the reduction staged in slices of TK; AP the pitch of a staged [k][m] operand. */
namespace emu_bwd_tiles {
constexpr int TM = 64, TN = 64, TK = 32, NT = 256;
constexpr int AP = TM + 4;
static_assert(NT % TK == 0 && NT % TM == 0 && NT % TN == 0 && NT % 128 == 0,
              "the staging loops give a thread one t, key or column");
} // namespace emu_bwd_tiles

/* The fast sums (emu_backward_fast.cu): whether they apply (grad_acc fp32 nearest-even, every dQ, dK, dV product
 * exact in fp32, the running sums fp32 values; FADEV_EMU_GENERIC=1 turns them off), and, per chunk, dq and then dK,
 * dV carried through the chunk's rows, reading the scratch P' (sa) and dS (sb). */
int emu_bwd_fast_ok(const bwd_args &a, const fadev_policy *pol, const fadev_policy_backward *pb);
fadev_status emu_bwd_fast_sums(const bwd_args &a, int64_t gn, int last_chunk);
/* The fast pair kernel (emu_backward_pairs.cu): s and dP as register-blocked fp32 FMA chains, P' and dS (flash) or
 * s and dP (baseline; with row_max, their rows' maxima too) written to the fp32 scratch (saf, sbf), where
 * emu_bwd_fast_ok holds, dP's and the scores' products are exact too, and (baseline) every value the rows kernel
 * keeps in the scratch is an fp32 value. */
int emu_bwd_fast_pairs_ok(const bwd_args &a);
fadev_status emu_bwd_fast_pairs(const bwd_args &a, int64_t gn);

/* R_dsoft_p(P), the softmax backward's P (steps 5 and 6). */
template <bool LEAN = false>
__device__ __forceinline__ double ps_of(const bwd_args &a, double p, int64_t bh, uint64_t idx) {
    return emu_rnd<LEAN>(a.dsoft_p, p, bwd_stream(EV_DSOFT_P, bh), idx);
}

/* dS = R_ds(R_dsoft(R_dsoft_p(P) R_dsoft(dP - D_i))), ds_scaled: R_dsoft(c .) before R_ds (step 6). */
template <bool LEAN = false>
__device__ __forceinline__ double ds_of(const bwd_args &a, double p, double dpv, double di, int64_t bh, uint64_t idx) {
    const double t = emu_rnd<LEAN>(a.dsoft, dpv - di, bwd_stream(EV_DSOFT_SUB, bh), idx);
    double u = emu_rnd<LEAN>(a.dsoft, ps_of<LEAN>(a, p, bh, idx) * t, bwd_stream(EV_DSOFT_MUL, bh), idx);
    if (a.ds_scaled) u = emu_rnd<LEAN>(a.dsoft, a.c_ds * u, bwd_stream(EV_DSOFT_SCALE, bh), idx);
    return emu_rnd<LEAN>(a.ds, u, bwd_stream(EV_DS, bh), idx);
}

/* ds_of's events as conversions (the lean kernels'), for dsoft_p, dsoft and ds of flt_kinds kdsp, kdso, kds and an
 * fp32 value p (R_dsoft_p and R_ds then round fp32 values: flt_round, which is dbl_round there). */
__device__ __forceinline__ float ds_lean(const bwd_args &a, int kdsp, int kdso, int kds, float p, double dpv,
                                         double di) {
    const double t = dbl_round(kdso, dpv - di);
    float u = dbl_round(kdso, (double)flt_round(kdsp, p) * t);
    if (a.ds_scaled) u = dbl_round(kdso, a.c_ds * (double)u);
    return flt_round(kds, u);
}

/* An order-preserving key of an fp32 value, for atomicMax: NaN above everything (att_max propagates it; payloads are
 * not part of the spec), -0 below +0 (a zero's sign in m changes no later value: exp(+-0) = 1); 0 below every key. */
__device__ __forceinline__ unsigned max_key(float x) {
    const unsigned u = __float_as_uint(x);
    return x != x ? 0xFFFFFFFFu : u >> 31 ? ~u : u | 0x80000000u;
}
__device__ __forceinline__ float max_of_key(unsigned k) {
    return k == 0xFFFFFFFFu ? __uint_as_float(0x7FC00000u) : __uint_as_float(k >> 31 ? k & 0x7FFFFFFFu : ~k);
}

/* The fast baseline rows kernels (emu_backward_rows.cu): baseline_rows_kernel's work with the same events, where the
 * fast pair kernel wrote the fp32 scratch and each of the rows' stages is fp32, bf16 or fp16 nearest-even
 * (naive's: emu_bwd_fast_rows_ok). */
int emu_bwd_fast_rows_ok(const bwd_args &a);
fadev_status emu_bwd_fast_rows(const bwd_args &a, int64_t gn);

#endif /* FADEV_EMU_BACKWARD_CUH */
