/* Deviation metrics of a result `test` against a reference `ref`.
 *
 * Element-wise d_i = test_i - ref_i in fp64 (n values):
 *   max_abs = max |d|            mean_diff = sum d / n        std_diff = sqrt(sum (d - mean_diff)^2 / n)
 *   mean_abs = sum |d| / n       rmse = sqrt(sum d^2 / n)     rel_l2 = sqrt(sum d^2) / sqrt(sum ref^2)
 *   max_rel = max |d_i| / |ref_i| over ref_i != 0 (NaN when every ref_i is 0)
 *   rel_l2 is 0 when every d_i is 0 and inf when ref is all zero but d is not.
 * Non-finite values follow IEEE arithmetic on these formulas:
 *   a NaN d (a NaN input, or the same infinity in test and ref) makes every metric NaN;
 *   otherwise an infinite d (an infinity on one side, opposite infinities, or an fp64 overflow of
 *   test - ref) makes max_abs, mean_abs, rmse inf, mean_diff +-inf (NaN when both signs occur),
 *   std_diff NaN, rel_l2 inf (NaN when ref holds an infinity: inf/inf), and max_rel NaN when
 *   ref holds an infinity (inf/inf), inf when some d_i is infinite where ref_i != 0.
 * Sums are Neumaier-compensated within fixed chunks of CHUNK elements; chunk results are combined in
 * chunk order with the same compensation, so the bits do not depend on the thread count and the
 * error bound (2u|S| + O(n u^2) sum|x|) stays ~u for 10^9 elements. std_diff: per chunk the sums of
 * (d - mean_c) and (d - mean_c)^2 from the cache-resident chunk, shifted exactly to the global mean
 * (corrected two-pass). If max |d| or max |ref| lies outside [2^-448, 2^448] the sums are redone with
 * d and ref scaled by exact powers of two, so squares neither overflow nor underflow.
 *
 * Wasserstein-1 between the empirical distributions of a (n_a values) and b (n_b values):
 *   W1 = integral |F_a(x) - F_b(x)| dx = integral_0^1 |Q_a(u) - Q_b(u)| du   (Q: quantile functions).
 *   sort path: given both sorted (by the caller: NumPy's np.sort), walk u over the merged breakpoints
 *     i/n_a, j/n_b, kept as exact integers in units of 1/L, L = lcm(n_a, n_b):
 *     W1 = sum len_k |a_(i) - b_(j)| / L. The walk
 *     is cut into segments by a-index (count fixed by n_a), each a compensated sum, added in order.
 *     Equal sizes reduce to sum |a_(i) - b_(i)| / n. IEEE rules apply to the terms: a NaN anywhere
 *     gives NaN, inf paired with the same inf gives NaN, inf paired with anything else gives inf
 *     (as scipy.stats.wasserstein_distance).
 *   counting path (both inputs finite and exact in bf16, else in fp16): histogram each input by its
 *     16-bit pattern in value order; over consecutive present values v < v',
 *     W1 = sum |c_a(v) n_b - c_b(v) n_a| (v' - v) / (n_a n_b)   (c: cumulative counts, exact integers).
 *
 * ULP error of test against ref in format (p, emin): |test - ref| / 2^(max(e, emin) - p + 1) with
 * 2^e <= |ref| < 2^(e+1) (ref = 0: e = emin; below 2^emin in a format without subnormals: / 2^emin,
 * as fadev.ulp); NaN when either is NaN or ref is infinite. The division is by a power of two, so
 * the only rounding is that of test - ref. Histogram bucket k holds errors in [k, k+1), the last
 * bucket errors >= max_ulp; NaN errors are counted apart. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "deviation.h"
#include "fadev.h"
#include "round.h"

enum {
    CHUNK = 16384,        /* elements per deviation chunk (fixed: the combination order depends on it) */
    ELEMENT_TASK = 32768, /* elements per task of the element-wise kernels */
    WALK_SEGMENT = 1 << 16,
    MAX_SEGMENTS = 256,
    PATTERNS = 1 << 16,
    MAX_COUNT_TASKS = 16
};

__extension__ typedef unsigned __int128 u128;

/* ------------------------------------------------------------ deviation */

typedef struct chunk_stats {
    dev_part t;       /* the chunk's totals (deviation.h) */
    nsum dev1, dev2;  /* sum (d*sd - mean_c), sum (d*sd - mean_c)^2 (all-finite chunks) */
    double mean_c;    /* scaled chunk mean of d, rounded (all-finite chunks only) */
} chunk_stats;

typedef struct deviation_job {
    const double *test, *ref;
    size_t n;
    double sd, sr; /* powers of two scaling d and ref in the sums */
    chunk_stats *chunks;
} deviation_job;

/* Every element is finite: no classification needed. Returns 0 if a non-finite d turned up. */
static int chunk_fast(const deviation_job *job, size_t begin, size_t end, chunk_stats *cs) {
    const double sd = job->sd, sr = job->sr;
    nsum sum_d = {0, 0}, sum_abs = {0, 0}, sum_sq = {0, 0}, sum_ref_sq = {0, 0};
    double max_abs = 0, max_ref = 0, max_rel = 0;
    uint64_t n_rel = 0;
    for (size_t i = begin; i < end; i++) {
        double r = job->ref[i];
        double d = job->test[i] - r;
        double ds = d * sd, rs = r * sr;
        double ad = fabs(d), ar = fabs(r);
        nadd(&sum_d, ds);
        nadd(&sum_abs, fabs(ds));
        nadd(&sum_sq, ds * ds);
        nadd(&sum_ref_sq, rs * rs);
        max_abs = ad > max_abs ? ad : max_abs;
        max_ref = ar > max_ref ? ar : max_ref;
        if (r != 0) {
            double rel = ad / ar;
            max_rel = rel > max_rel ? rel : max_rel;
            n_rel++;
        }
    }
    /* a NaN d makes sum_abs NaN (|d| >= 0, so an overflowing sum becomes inf, never NaN) */
    if (isnan(sum_abs.s) || isinf(max_abs)) return 0;
    cs->t.sum_d = sum_d;
    cs->t.sum_abs = sum_abs;
    cs->t.sum_sq = sum_sq;
    cs->t.sum_ref_sq = sum_ref_sq;
    cs->t.max_abs = max_abs;
    cs->t.max_ref = max_ref;
    cs->t.max_rel = max_rel;
    cs->t.n_finite = end - begin;
    cs->t.n_rel = n_rel;
    /* second pass over the cache-resident chunk: deviations from the (rounded) chunk mean */
    double mean_c = nval(sum_d) / (double)(end - begin);
    nsum dev1 = {0, 0}, dev2 = {0, 0};
    for (size_t i = begin; i < end; i++) {
        double e = (job->test[i] - job->ref[i]) * sd - mean_c;
        nadd(&dev1, e);
        nadd(&dev2, e * e);
    }
    cs->dev1 = dev1;
    cs->dev2 = dev2;
    cs->mean_c = mean_c;
    return 1;
}

/* Some element is NaN or infinite: classify each, sum the finite d. */
static void chunk_careful(const deviation_job *job, size_t begin, size_t end, chunk_stats *cs) {
    const double sd = job->sd, sr = job->sr;
    for (size_t i = begin; i < end; i++) {
        double t = job->test[i], r = job->ref[i];
        double d = t - r;
        if (isnan(t) || isnan(r))
            cs->t.n_nan_in++;
        else if (isinf(t) || isinf(r))
            cs->t.n_inf_in++;
        if (isinf(r)) cs->t.n_ref_inf++;
        if (r != 0) {
            double rel = fabs(d) / fabs(r);
            cs->t.n_rel++;
            if (isnan(rel))
                cs->t.rel_nan = 1;
            else if (rel > cs->t.max_rel)
                cs->t.max_rel = rel;
        }
        if (isnan(d)) {
            cs->t.n_nan_d++;
            continue;
        }
        if (isinf(d)) {
            if (d > 0)
                cs->t.n_pos_inf_d++;
            else
                cs->t.n_neg_inf_d++;
            continue;
        }
        double ds = d * sd, rs = r * sr;
        nadd(&cs->t.sum_d, ds);
        nadd(&cs->t.sum_abs, fabs(ds));
        nadd(&cs->t.sum_sq, ds * ds);
        nadd(&cs->t.sum_ref_sq, rs * rs);
        if (fabs(d) > cs->t.max_abs) cs->t.max_abs = fabs(d);
        if (fabs(r) > cs->t.max_ref) cs->t.max_ref = fabs(r);
        cs->t.n_finite++;
    }
}

static fadev_status deviation_task(void *ctx, size_t task) {
    const deviation_job *job = (const deviation_job *)ctx;
    size_t begin = task * CHUNK;
    size_t end = begin + CHUNK < job->n ? begin + CHUNK : job->n;
    chunk_stats *cs = &job->chunks[task];
    memset(cs, 0, sizeof *cs);
    if (!chunk_fast(job, begin, end, cs)) {
        memset(cs, 0, sizeof *cs);
        chunk_careful(job, begin, end, cs);
    }
    return FADEV_OK;
}

fadev_status fadev_deviation_stats(const double *test, const double *ref, size_t n, fadev_deviation *out) {
    if (n == 0) return FADEV_ERR_INVALID_ARGUMENT;
    size_t n_chunks = (n + CHUNK - 1) / CHUNK;
    deviation_job job = {test, ref, n, 1.0, 1.0, NULL};
    job.chunks = (chunk_stats *)malloc(n_chunks * sizeof *job.chunks);
    if (!job.chunks) return FADEV_ERR_NO_MEMORY;
    fadev_status st = fadev_parallel_for(n_chunks, deviation_task, &job);
    dev_part tot;
    int kd = 0, kr = 0;
    for (int sweep = 0; st == FADEV_OK && sweep < 2; sweep++) {
        memset(&tot, 0, sizeof tot);
        for (size_t c = 0; c < n_chunks; c++) dev_combine(&tot, &job.chunks[c].t);
        /* squares of values outside [2^-448, 2^448] may overflow or underflow: sum again, scaled */
        if (sweep == 0 && dev_rescale(&tot, &job.sd, &job.sr, &kd, &kr))
            st = fadev_parallel_for(n_chunks, deviation_task, &job);
        else
            break;
    }
    if (st == FADEV_OK && !dev_finish_nonfinite(&tot, n, out)) {
        /* every d is finite; with h_c = mean_c - mean, exactly: sum_c (d - mean)^k over chunk c =
         * dev2_c + 2 h_c dev1_c + n_c h_c^2 (k = 2), dev1_c + n_c h_c (k = 1) */
        double mean_s = nval(tot.sum_d) / (double)n;
        nsum t1 = {0, 0}, t2 = {0, 0};
        for (size_t c = 0; c < n_chunks; c++) {
            const chunk_stats *cs = &job.chunks[c];
            double h = cs->mean_c - mean_s, nc = (double)cs->t.n_finite;
            nadd_sum(&t2, cs->dev2);
            nadd(&t2, 2.0 * h * nval(cs->dev1));
            nadd(&t2, nc * (h * h));
            nadd_sum(&t1, cs->dev1);
            nadd(&t1, nc * h);
        }
        dev_finish_finite(&tot, n, mean_s, t1, t2, job.sd, kd, kr, out);
    }
    free(job.chunks);
    return st;
}

/* ------------------------------------------------------------ Wasserstein: sort path */

static u128 gcd128(u128 x, u128 y) {
    while (y) {
        u128 t = x % y;
        x = y;
        y = t;
    }
    return x;
}

typedef struct walk_job {
    const double *a, *b; /* sorted */
    size_t n_a, n_b;
    u128 wa, wb;         /* u-length of one element of a, of b, in units of 1/L */
    double scale;        /* power of two applied to |a_i - b_j| so the sum cannot overflow */
    size_t n_segments;
    nsum *partial;
} walk_job;

static fadev_status walk_task(void *ctx, size_t s) {
    const walk_job *job = (const walk_job *)ctx;
    size_t i = (size_t)((u128)s * job->n_a / job->n_segments);
    size_t i_end = (size_t)((u128)(s + 1) * job->n_a / job->n_segments);
    const u128 wa = job->wa, wb = job->wb;
    const double scale = job->scale;
    nsum sum = {0, 0};
    if (job->n_a == job->n_b) { /* every step has length 1: the same terms, without the bookkeeping */
        for (; i < i_end; i++) nadd(&sum, fabs(job->a[i] - job->b[i]) * scale);
        job->partial[s] = sum;
        return FADEV_OK;
    }
    u128 pos = (u128)i * wa, end = (u128)i_end * wa;
    size_t j = (size_t)(pos / wb);
    u128 next_a = pos + wa, next_b = (u128)(j + 1) * wb;
    while (pos < end) {
        u128 next = next_a < next_b ? next_a : next_b;
        uint64_t len = (uint64_t)(next - pos); /* <= max(wa, wb) = max(n_a, n_b) / gcd < 2^64 */
        nadd(&sum, (double)len * (fabs(job->a[i] - job->b[j]) * scale));
        pos = next;
        if (next_a == next) {
            i++;
            next_a += wa;
        }
        if (next_b == next) {
            j++;
            next_b += wb;
        }
    }
    job->partial[s] = sum;
    return FADEV_OK;
}

/* a and b ascending, NaNs (if any) last; -0 and +0 in either order (|x - -0| = |x - +0|). */
static fadev_status w1_sorted(const double *a, size_t n_a, const double *b, size_t n_b, double *out) {
    if (isnan(a[0]) || isnan(a[n_a - 1]) || isnan(b[0]) || isnan(b[n_b - 1])) { /* NaNs sort to the ends */
        *out = NAN;
        return FADEV_OK;
    }
    u128 g = gcd128(n_a, n_b);
    u128 L = (u128)n_a / g * n_b;
    walk_job job = {a, b, n_a, n_b, L / n_a, L / n_b, 1.0, 0, NULL};
    double top = fmax(fmax(fabs(a[0]), fabs(a[n_a - 1])), fmax(fabs(b[0]), fabs(b[n_b - 1])));
    double dl = (double)L;
    if (isfinite(top) && top > 0 && ilogb(top) + ilogb(dl) > 1000) /* sum <= 2 * top * L */
        job.scale = ldexp(1.0, 1000 - ilogb(top) - ilogb(dl));
    job.n_segments = (n_a + WALK_SEGMENT - 1) / WALK_SEGMENT;
    if (job.n_segments > MAX_SEGMENTS) job.n_segments = MAX_SEGMENTS;
    job.partial = (nsum *)malloc(job.n_segments * sizeof *job.partial);
    if (!job.partial) return FADEV_ERR_NO_MEMORY;
    fadev_status st = fadev_parallel_for(job.n_segments, walk_task, &job);
    nsum total = {0, 0};
    for (size_t s = 0; s < job.n_segments; s++) nadd_sum(&total, job.partial[s]);
    free(job.partial);
    *out = nval(total) / dl / job.scale;
    return st;
}

/* ------------------------------------------------------------ Wasserstein: counting path */

typedef struct count_job {
    const double *a, *b;
    size_t n_a, n_b, n_tasks;
    fadev_format fmt;  /* a 16-bit format: bf16 or fp16 */
    double sub_scale;  /* 2^(p - 1 - emin): a subnormal's value -> its fraction field */
    uint64_t *hist;    /* per task: PATTERNS counts for a, then PATTERNS for b, by order key */
    atomic_int failed; /* some value is not a finite number of fmt */
} count_job;

/* Order key of a finite value exact in a 16-bit format: the bit pattern, sign handled so that
 * key order is value order (-0 and +0 adjacent). */
static inline unsigned order_key16(double x, const count_job *job) {
    uint64_t u = fadev_bits_of(x);
    uint64_t mag = u & 0x7FFFFFFFFFFFFFFFull;
    const int frac_bits = job->fmt.precision - 1;
    unsigned pattern = 0;
    if (mag) {
        int e = (int)(mag >> 52) - 1023; /* x is a normal fp64 number: 16-bit formats reach only 2^-133 */
        if (e < job->fmt.emin)
            pattern = (unsigned)(fabs(x) * job->sub_scale);
        else
            pattern = ((unsigned)(e - job->fmt.emin + 1) << frac_bits) |
                      (unsigned)((mag & 0x000FFFFFFFFFFFFFull) >> (52 - frac_bits));
    }
    return (u >> 63) ? 0x7FFFu - pattern : 0x8000u | pattern;
}

static double value_of_key16(unsigned key, const fadev_format *f) {
    int negative = key < 0x8000u;
    unsigned pattern = negative ? 0x7FFFu - key : key - 0x8000u;
    int frac_bits = f->precision - 1;
    unsigned field = pattern >> frac_bits, frac = pattern & ((1u << frac_bits) - 1);
    double v = field == 0 ? ldexp((double)frac, f->emin - frac_bits)
                          : ldexp(1.0 + ldexp((double)frac, -frac_bits), (int)field - 1 + f->emin);
    return negative ? -v : v;
}

static fadev_status count_task(void *ctx, size_t task) {
    count_job *job = (count_job *)ctx;
    size_t total = job->n_a + job->n_b;
    size_t begin = (size_t)((u128)task * total / job->n_tasks);
    size_t end = (size_t)((u128)(task + 1) * total / job->n_tasks);
    uint64_t *ha = job->hist + task * 2 * PATTERNS, *hb = ha + PATTERNS;
    memset(ha, 0, 2 * PATTERNS * sizeof *ha);
    const fadev_format fmt = job->fmt;
    for (size_t i = begin; i < end; i++) {
        if ((i & 4095) == 0 && atomic_load_explicit(&job->failed, memory_order_relaxed)) return FADEV_OK;
        int in_a = i < job->n_a;
        double x = in_a ? job->a[i] : job->b[i - job->n_a];
        if (!isfinite(x) || fadev_round_one(x, &fmt, FADEV_ROUND_NEAREST_EVEN, 0) != x) {
            atomic_store(&job->failed, 1);
            return FADEV_OK;
        }
        (in_a ? ha : hb)[order_key16(x, job)]++;
    }
    return FADEV_OK;
}

/* 1 with *out = W1 if every value of a and b is a finite number of fmt, else 0; *st: a failure. */
static int w1_count_path(const double *a, size_t n_a, const double *b, size_t n_b, const fadev_format *fmt,
                         uint64_t *hist, size_t n_tasks, double *out, fadev_status *st) {
    count_job job;
    job.a = a;
    job.b = b;
    job.n_a = n_a;
    job.n_b = n_b;
    job.n_tasks = n_tasks;
    job.fmt = *fmt;
    job.sub_scale = ldexp(1.0, fmt->precision - 1 - fmt->emin);
    job.hist = hist;
    atomic_init(&job.failed, 0);
    *st = fadev_parallel_for(n_tasks, count_task, &job);
    if (*st != FADEV_OK || atomic_load(&job.failed)) return 0;
    u128 g = gcd128(n_a, n_b);
    u128 wa = (u128)n_b / g, wb = (u128)n_a / g; /* |c_a/n_a - c_b/n_b| = |c_a wa - c_b wb| / L */
    u128 L = (u128)n_a * wa;
    u128 ca = 0, cb = 0;
    nsum sum = {0, 0};
    double prev = 0;
    int have_prev = 0;
    for (unsigned key = 0; key < PATTERNS; key++) {
        uint64_t ka = 0, kb = 0;
        for (size_t t = 0; t < n_tasks; t++) {
            ka += hist[t * 2 * PATTERNS + key];
            kb += hist[t * 2 * PATTERNS + PATTERNS + key];
        }
        if (ka + kb == 0) continue;
        double v = value_of_key16(key, fmt);
        if (have_prev) {
            u128 x = ca * wa, y = cb * wb;
            u128 num = x > y ? x - y : y - x;
            if (num) nadd(&sum, (double)num * (v - prev)); /* v - prev is exact or rounded once */
        }
        ca += ka;
        cb += kb;
        prev = v;
        have_prev = 1;
    }
    *out = nval(sum) / (double)L;
    return 1;
}

fadev_status fadev_wasserstein(const double *a, size_t n_a, const double *b, size_t n_b, int method, double *out,
                               int *method_used) {
    if (n_a == 0 || n_b == 0) return FADEV_ERR_INVALID_ARGUMENT;
    if (method != FADEV_W1_AUTO && method != FADEV_W1_SORT && method != FADEV_W1_COUNT)
        return FADEV_ERR_INVALID_ARGUMENT;
    size_t total = n_a + n_b;
    if (method == FADEV_W1_COUNT || (method == FADEV_W1_AUTO && total >= PATTERNS)) {
        fadev_format formats[2];
        fadev_status made = fadev_format_make(8, -126, 127, 1, 1, FADEV_OVERFLOW_INF, 0, &formats[0]); /* bf16 */
        if (made == FADEV_OK) made = fadev_format_make(11, -14, 15, 1, 1, FADEV_OVERFLOW_INF, 0, &formats[1]); /* fp16 */
        if (made != FADEV_OK) return made;
        size_t n_tasks = (total + (1u << 18) - 1) >> 18;
        if (n_tasks > MAX_COUNT_TASKS) n_tasks = MAX_COUNT_TASKS;
        if (n_tasks > (size_t)fadev_get_num_threads()) n_tasks = (size_t)fadev_get_num_threads();
        /* (integer counts: the task split cannot change the result) */
        uint64_t *hist = (uint64_t *)malloc(n_tasks * 2 * PATTERNS * sizeof *hist);
        if (!hist) return FADEV_ERR_NO_MEMORY;
        fadev_status st = FADEV_OK;
        int done = 0;
        for (int f = 0; f < 2 && !done && st == FADEV_OK; f++)
            done = w1_count_path(a, n_a, b, n_b, &formats[f], hist, n_tasks, out, &st);
        free(hist);
        if (st != FADEV_OK) return st;
        if (done) {
            *method_used = FADEV_W1_COUNT;
            return FADEV_OK;
        }
        if (method == FADEV_W1_COUNT) return FADEV_ERR_NOT_REPRESENTABLE;
    }
    *method_used = FADEV_W1_SORT;
    if (method == FADEV_W1_AUTO) return FADEV_OK; /* nothing computed: the caller sorts, then asks for the walk */
    return w1_sorted(a, n_a, b, n_b, out);
}

/* ------------------------------------------------------------ ULP error */

/* ulp(ref) = 2^q: q = max(e, emin) - p + 1; below 2^emin without subnormals q = emin (fadev.ulp) */
static inline double ulp_error_one(double t, double r, int emin, int p, int q_below) {
    uint64_t ur = fadev_bits_of(r);
    int biased = (int)((ur >> 52) & 0x7FF);
    if (biased == 0x7FF) return NAN; /* ref is NaN or infinite */
    double d = fabs(t - r);
    int e = biased - 1023;           /* fp64 subnormals and 0 (biased 0) lie below every emin */
    int q = biased && e >= emin ? e - p + 1 : q_below;
    if (q >= -1023 && q <= 1022) return d * fadev_double_of((uint64_t)(1023 - q) << 52);
    return ldexp(d, -q);
}

typedef struct ulp_job {
    const double *test, *ref;
    size_t n;
    int emin, p, q_below;  /* fmt's emin, precision; exponent of ulp(ref) for |ref| < 2^emin */
    double *out;           /* error per element (ulp_error) */
    size_t max_ulp, n_tasks;
    uint64_t *counts;      /* per task: max_ulp + 2 counts (the last: NaN) */
} ulp_job;

static int ulp_exponent_below(const fadev_format *fmt) {
    return fmt->subnormals ? fmt->emin - fmt->precision + 1 : fmt->emin;
}

static fadev_status ulp_error_task(void *ctx, size_t task) {
    const ulp_job *job = (const ulp_job *)ctx;
    size_t begin = task * ELEMENT_TASK;
    size_t end = begin + ELEMENT_TASK < job->n ? begin + ELEMENT_TASK : job->n;
    for (size_t i = begin; i < end; i++)
        job->out[i] = ulp_error_one(job->test[i], job->ref[i], job->emin, job->p, job->q_below);
    return FADEV_OK;
}

fadev_status fadev_ulp_error(const double *test, const double *ref, size_t n, const fadev_format *fmt, double *out) {
    ulp_job job = {test, ref, n, fmt->emin, fmt->precision, ulp_exponent_below(fmt), out, 0, 0, NULL};
    return fadev_parallel_for((n + ELEMENT_TASK - 1) / ELEMENT_TASK, ulp_error_task, &job);
}

static fadev_status ulp_histogram_task(void *ctx, size_t task) {
    const ulp_job *job = (const ulp_job *)ctx;
    size_t begin = (size_t)((u128)task * job->n / job->n_tasks);
    size_t end = (size_t)((u128)(task + 1) * job->n / job->n_tasks);
    uint64_t *c = job->counts + task * (job->max_ulp + 2);
    memset(c, 0, (job->max_ulp + 2) * sizeof *c);
    const double top = (double)job->max_ulp;
    for (size_t i = begin; i < end; i++) {
        double err = ulp_error_one(job->test[i], job->ref[i], job->emin, job->p, job->q_below);
        if (err != err)
            c[job->max_ulp + 1]++;
        else
            c[err >= top ? job->max_ulp : (size_t)err]++;
    }
    return FADEV_OK;
}

fadev_status fadev_ulp_histogram(const double *test, const double *ref, size_t n, const fadev_format *fmt,
                                 size_t max_ulp, uint64_t *counts, uint64_t *n_nan) {
    if (max_ulp < 1 || max_ulp > (1u << 20)) return FADEV_ERR_INVALID_ARGUMENT;
    /* integer counts: the task split cannot change the result; keep the scratch under ~32 MB */
    size_t n_tasks = (n + ELEMENT_TASK - 1) / ELEMENT_TASK;
    size_t cap = ((size_t)1 << 22) / (max_ulp + 2);
    if (n_tasks > MAX_COUNT_TASKS) n_tasks = MAX_COUNT_TASKS;
    if (n_tasks > cap) n_tasks = cap;
    if (n_tasks < 1) n_tasks = 1;
    ulp_job job = {test, ref, n, fmt->emin, fmt->precision, ulp_exponent_below(fmt), NULL, max_ulp, n_tasks, NULL};
    job.counts = (uint64_t *)malloc(n_tasks * (max_ulp + 2) * sizeof *job.counts);
    if (!job.counts) return FADEV_ERR_NO_MEMORY;
    fadev_status st = fadev_parallel_for(n_tasks, ulp_histogram_task, &job);
    if (st == FADEV_OK) {
        memset(counts, 0, (max_ulp + 1) * sizeof *counts);
        *n_nan = 0;
        for (size_t t = 0; t < n_tasks; t++) {
            const uint64_t *c = job.counts + t * (max_ulp + 2);
            for (size_t k = 0; k <= max_ulp; k++) counts[k] += c[k];
            *n_nan += c[max_ulp + 1];
        }
    }
    free(job.counts);
    return st;
}
