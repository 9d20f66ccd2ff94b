/* The deviation statistics' shared arithmetic: compensated sums, per-part totals, the choice of scaling and
 * the finishing step of fadev_deviation_stats, compiled into both metrics.c (CPU) and cuda/metrics.cu (GPU)
 * as round.h is, so the two follow one definition (metrics.c's top comment is the spec). */
#ifndef FADEV_DEVIATION_H
#define FADEV_DEVIATION_H

#include <math.h>
#include <stdint.h>

#include "fadev.h"
#include "round.h"

/* ------------------------------------------------------------ compensated (Neumaier) sums */

typedef struct nsum {
    double s, c; /* the value is s + c */
} nsum;

FADEV_HD int dev_finite(double x) { return (fadev_bits_of(x) & 0x7FF0000000000000ull) != 0x7FF0000000000000ull; }

FADEV_HD void nadd(nsum *a, double x) {
    double t = a->s + x;
    if (fabs(a->s) >= fabs(x))
        a->c += (a->s - t) + x;
    else
        a->c += (x - t) + a->s;
    a->s = t;
}

/* Once s is inf or NaN, c holds inf - inf garbage: s alone is the IEEE result of the sum. */
FADEV_HD void nadd_sum(nsum *a, nsum b) {
    nadd(a, b.s);
    if (dev_finite(b.s)) nadd(a, b.c);
}

FADEV_HD double nval(nsum a) { return dev_finite(a.s) ? a.s + a.c : a.s; }

/* ------------------------------------------------------------ totals of a part of the data */

typedef struct dev_part {
    nsum sum_d, sum_abs, sum_sq, sum_ref_sq; /* over finite d, scaled by sd (d) and sr (ref) */
    double max_abs, max_ref, max_rel;        /* unscaled; max_rel over ref != 0, NaN ratios apart */
    uint64_t n_finite, n_rel;                /* finite d; ref != 0 */
    uint64_t n_nan_in, n_inf_in, n_nan_d, n_pos_inf_d, n_neg_inf_d, n_ref_inf;
    int rel_nan;                             /* some |d| / |ref| with ref != 0 is NaN */
} dev_part;

/* a += b (parts combined in a fixed order give fixed bits) */
FADEV_HD void dev_combine(dev_part *a, const dev_part *b) {
    nadd_sum(&a->sum_d, b->sum_d);
    nadd_sum(&a->sum_abs, b->sum_abs);
    nadd_sum(&a->sum_sq, b->sum_sq);
    nadd_sum(&a->sum_ref_sq, b->sum_ref_sq);
    a->max_abs = b->max_abs > a->max_abs ? b->max_abs : a->max_abs;
    a->max_ref = b->max_ref > a->max_ref ? b->max_ref : a->max_ref;
    a->max_rel = b->max_rel > a->max_rel ? b->max_rel : a->max_rel;
    a->n_finite += b->n_finite;
    a->n_rel += b->n_rel;
    a->n_nan_in += b->n_nan_in;
    a->n_inf_in += b->n_inf_in;
    a->n_nan_d += b->n_nan_d;
    a->n_pos_inf_d += b->n_pos_inf_d;
    a->n_neg_inf_d += b->n_neg_inf_d;
    a->n_ref_inf += b->n_ref_inf;
    a->rel_nan |= b->rel_nan;
}

/* ------------------------------------------------------------ scaling and the finishing step */

/* 2^k for the k that brings m (> 0) into [1, 2), clamped to a representable power; *k_out = k. */
static inline double dev_scale_for(double m, int *k_out) {
    int e = ilogb(m);
    int k = -e;
    if (k > 1023) k = 1023;
    if (k < -1022) k = -1022;
    *k_out = k;
    return ldexp(1.0, k);
}

static inline int dev_needs_scaling(double m) { return m > 0x1p448 || (m > 0 && m < 0x1p-448); }

/* After a first sweep with totals t: 1 if the squares of values outside [2^-448, 2^448] may overflow or
 * underflow, so the sweep must be redone with d scaled by *sd = 2^*kd and ref by *sr = 2^*kr (left as 1, 0
 * where not needed); 0 otherwise (and when some d is not finite: the sums are then not used). */
static inline int dev_rescale(const dev_part *t, double *sd, double *sr, int *kd, int *kr) {
    if (t->n_nan_d + t->n_pos_inf_d + t->n_neg_inf_d) return 0;
    if (!dev_needs_scaling(t->max_abs) && !dev_needs_scaling(t->max_ref)) return 0;
    if (dev_needs_scaling(t->max_abs)) *sd = dev_scale_for(t->max_abs, kd);
    if (dev_needs_scaling(t->max_ref)) *sr = dev_scale_for(t->max_ref, kr);
    return 1;
}

/* The counts, and when some d is NaN or infinite every metric by the IEEE rules: returns 1 (*out complete).
 * Returns 0 when every d is finite: the caller then sums the spread and calls dev_finish_finite. */
static inline int dev_finish_nonfinite(const dev_part *t, uint64_t n, fadev_deviation *out) {
    out->n = n;
    out->n_nan = t->n_nan_in;
    out->n_inf = t->n_inf_in;
    if (t->n_nan_d) {
        out->max_abs = out->mean_diff = out->std_diff = out->mean_abs = out->rmse = out->rel_l2 = out->max_rel = NAN;
        return 1;
    }
    if (t->n_pos_inf_d || t->n_neg_inf_d) {
        out->max_abs = out->mean_abs = out->rmse = INFINITY;
        out->mean_diff = t->n_pos_inf_d && t->n_neg_inf_d ? NAN : t->n_pos_inf_d ? INFINITY : -INFINITY;
        out->std_diff = NAN;
        out->rel_l2 = t->n_ref_inf ? NAN : INFINITY;
        out->max_rel = t->rel_nan ? NAN : t->n_rel ? t->max_rel : NAN;
        return 1;
    }
    return 0;
}

/* Every d finite; sums are of d * sd (sd = 2^kd) and ref * 2^kr. mean_s = nval(t->sum_d) / n; dev1, dev2: the
 * sums of (d sd - mean_s) and its square. M2 = T2 - T1^2 / n removes what the rounding of mean leaves
 * (corrected two-pass). */
static inline void dev_finish_finite(const dev_part *t, uint64_t n, double mean_s, nsum dev1, nsum dev2, double sd,
                                     int kd, int kr, fadev_deviation *out) {
    const double dn = (double)n;
    double t1v = nval(dev1);
    double m2v = nval(dev2) - t1v * (t1v / dn);
    double ss = nval(t->sum_sq), rr = nval(t->sum_ref_sq);
    out->max_abs = t->max_abs;
    out->mean_diff = mean_s / sd;
    out->std_diff = sqrt(m2v > 0 ? m2v / dn : 0.0) / sd;
    out->mean_abs = (nval(t->sum_abs) / dn) / sd;
    out->rmse = sqrt(ss / dn) / sd;
    if (ss == 0)
        out->rel_l2 = 0.0;
    else if (rr == 0)
        out->rel_l2 = INFINITY;
    else
        out->rel_l2 = ldexp(sqrt(ss) / sqrt(rr), kr - kd);
    out->max_rel = t->n_rel ? t->max_rel : NAN;
}

#endif /* FADEV_DEVIATION_H */
