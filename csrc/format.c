/* Formats: construction, bit layouts, and array rounding (the scalar rule lives in round.h, shared
 * with the CUDA kernels). Arrays are split into fixed 32768-element tasks so any thread count gives
 * the same bits; the stochastic generator is keyed by the element's global index, not the task.
 * Nearest-even and toward-zero take a vectorised fast path for elements in the target's normal range
 * (see round_fast) and the scalar rule for the rest, so results are the scalar rule's bit for bit. */
#include <math.h>
#include <string.h>

#include "fadev.h"
#include "round.h"

enum { ROUND_TASK = 32768 };

static const char *const status_strings[FADEV_STATUS_COUNT] = {
    "ok",
    "invalid format parameters",
    "invalid rounding mode",
    "invalid argument",
    "shape mismatch",
    "size overflow",
    "out of memory",
    "could not start a worker thread",
    "format has no bit encoding of that width",
    "CUDA runtime error",
    "CUDA not available",
};

const char *fadev_status_string(fadev_status status) {
    if ((int)status < 0 || status >= FADEV_STATUS_COUNT) return "unknown status";
    return status_strings[status];
}

fadev_status fadev_format_make(int precision, int emin, int emax, int subnormals, int has_inf,
                               int overflow, double largest, fadev_format *fmt) {
    if (precision < 1 || precision > 53) return FADEV_ERR_INVALID_FORMAT;
    if (emin > emax || emin < -1022 || emax > 1023) return FADEV_ERR_INVALID_FORMAT;
    if (emin - precision + 1 < -1074) return FADEV_ERR_INVALID_FORMAT;
    if (overflow < FADEV_OVERFLOW_INF || overflow > FADEV_OVERFLOW_SATURATE) return FADEV_ERR_INVALID_FORMAT;
    if (overflow == FADEV_OVERFLOW_INF && !has_inf) return FADEV_ERR_INVALID_FORMAT;
    double full = ldexp(2.0 - ldexp(1.0, 1 - precision), emax);
    if (!(largest > 0)) largest = full;
    if (largest > full || largest < ldexp(1.0, emax) || isinf(largest)) return FADEV_ERR_INVALID_FORMAT;
    fmt->precision = precision;
    fmt->emin = emin;
    fmt->emax = emax;
    fmt->subnormals = subnormals ? 1 : 0;
    fmt->has_inf = has_inf ? 1 : 0;
    fmt->overflow = overflow;
    fmt->largest = largest;
    /* `largest` must itself be a value of the format */
    if (fadev_round_one(largest, fmt, FADEV_ROUND_NEAREST_EVEN, 0) != largest) return FADEV_ERR_INVALID_FORMAT;
    return FADEV_OK;
}

fadev_status fadev_format_layout(const fadev_format *fmt, int *exponent_bits, int *total_bits) {
    int bias = 1 - fmt->emin;
    long top_field = (long)fmt->emax + bias + (fmt->has_inf ? 1 : 0); /* inf/NaN take their own field */
    int k = 1;
    while ((1L << k) - 1 < top_field) k++;
    *exponent_bits = k;
    *total_bits = 1 + k + fmt->precision - 1;
    return FADEV_OK;
}

static int valid_mode(int mode) {
    return mode == FADEV_ROUND_NEAREST_EVEN || mode == FADEV_ROUND_TOWARD_ZERO || mode == FADEV_ROUND_STOCHASTIC;
}

typedef struct round_job {
    const double *x64;
    const float *x32;
    double *out;
    size_t n;
    const fadev_format *fmt;
    int mode;
    uint64_t seed, stream, index_offset;
} round_job;

/* --- fast path for nearest-even and toward-zero ---
 * For |x| whose float64 encoding `a` lies in [lo, hi] = [encoding of 2^emin, encoding of largest], x is
 * normal in the target and its rounded magnitude cannot exceed `largest` (rounding is monotone and
 * `largest` rounds to itself), so fadev_round_one reduces to its normal branch:
 *   r = (a + add + (lsb_of_kept & lsb_mask)) & ~dropped_mask
 * with add = 2^(shift-1) - 1, lsb_mask = 1 for nearest-even (a carry past the half-way point, ties to
 * the even kept bit) and add = 0, lsb_mask = 0 for toward zero. The loop below does exactly that with
 * no branches so that the compiler vectorises it (AVX2 chosen at run time where the compiler supports
 * target_clones); elements outside [lo, hi] (zeros, target subnormals, overflow, inf, NaN) are flagged
 * and redone by fadev_round_one, so results are identical to the scalar rule. */
enum { FAST_BLOCK = 256 };

typedef struct fast_rule {
    uint64_t lo, span;    /* fast iff a - lo <= span (unsigned) */
    uint64_t add, lsb;    /* see above */
    uint64_t keep;        /* ~dropped_mask */
    int shift;            /* 53 - precision, >= 1 */
} fast_rule;

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define FADEV_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef FADEV_CLONES
#define FADEV_CLONES
#endif

#define FAST_BODY(load)                                                            \
    size_t slow = 0;                                                               \
    for (size_t i = 0; i < n; i++) {                                               \
        double v = (load);                                                         \
        uint64_t u;                                                                \
        memcpy(&u, &v, sizeof u);                                                  \
        uint64_t sign = u & 0x8000000000000000ull;                                 \
        uint64_t a = u ^ sign;                                                     \
        uint64_t r = ((a + rule.add + ((a >> rule.shift) & rule.lsb)) & rule.keep) | sign; \
        slow += (a - rule.lo) > rule.span;                                         \
        memcpy(&buf[i], &r, sizeof r);                                             \
    }                                                                              \
    return slow

/* buf[i] = fast rounding of x[i], i < n <= FAST_BLOCK; returns how many elements need the scalar rule. */
FADEV_CLONES static size_t fast_block_f64(const double *restrict x, double *restrict buf, size_t n, fast_rule rule) {
    FAST_BODY(x[i]);
}

FADEV_CLONES static size_t fast_block_f32(const float *restrict x, double *restrict buf, size_t n, fast_rule rule) {
    FAST_BODY((double)x[i]);
}

static void round_fast(const round_job *job, const fadev_format *fmt, size_t begin, size_t end) {
    fast_rule rule;
    rule.shift = 53 - fmt->precision;
    rule.lo = (uint64_t)(fmt->emin + 1023) << 52;
    rule.span = fadev_bits_of(fmt->largest) - rule.lo;
    rule.keep = ~((1ull << rule.shift) - 1);
    int nearest = job->mode == FADEV_ROUND_NEAREST_EVEN;
    rule.add = nearest ? (1ull << (rule.shift - 1)) - 1 : 0;
    rule.lsb = nearest ? 1 : 0;
    if (nearest && fmt->precision == 1) { /* the kept significand is the implicit 1: ties go up */
        rule.add += 1;
        rule.lsb = 0;
    }
    double buf[FAST_BLOCK]; /* out may alias x: the slow elements are redone from x before out is written */
    for (size_t b = begin; b < end; b += FAST_BLOCK) {
        size_t n = end - b < FAST_BLOCK ? end - b : FAST_BLOCK;
        size_t slow = job->x64 ? fast_block_f64(job->x64 + b, buf, n, rule) : fast_block_f32(job->x32 + b, buf, n, rule);
        for (size_t i = 0; slow && i < n; i++) {
            double v = job->x64 ? job->x64[b + i] : (double)job->x32[b + i];
            if ((fadev_bits_of(fabs(v)) - rule.lo) > rule.span) {
                buf[i] = fadev_round_one(v, fmt, job->mode, 0);
                slow--;
            }
        }
        memcpy(job->out + b, buf, n * sizeof(double));
    }
}

static fadev_status round_task(void *ctx, size_t task) {
    const round_job *job = (const round_job *)ctx;
    size_t begin = task * ROUND_TASK;
    size_t end = begin + ROUND_TASK < job->n ? begin + ROUND_TASK : job->n;
    const fadev_format fmt = *job->fmt;
    const int mode = job->mode;
    if (mode == FADEV_ROUND_STOCHASTIC) {
        for (size_t i = begin; i < end; i++) {
            double x = job->x64 ? job->x64[i] : (double)job->x32[i];
            uint64_t r = fadev_random53(job->seed, job->stream, job->index_offset + i);
            job->out[i] = fadev_round_one(x, &fmt, mode, r);
        }
    } else if (fmt.precision < 53) {
        round_fast(job, &fmt, begin, end);
    } else if (job->x64) {
        for (size_t i = begin; i < end; i++) job->out[i] = fadev_round_one(job->x64[i], &fmt, mode, 0);
    } else {
        for (size_t i = begin; i < end; i++) job->out[i] = fadev_round_one((double)job->x32[i], &fmt, mode, 0);
    }
    return FADEV_OK;
}

static fadev_status round_any(const double *x64, const float *x32, double *out, size_t n, const fadev_format *fmt,
                              int mode, uint64_t seed, uint64_t stream, uint64_t index_offset) {
    if (!valid_mode(mode)) return FADEV_ERR_INVALID_MODE;
    round_job job = {x64, x32, out, n, fmt, mode, seed, stream, index_offset};
    return fadev_parallel_for((n + ROUND_TASK - 1) / ROUND_TASK, round_task, &job);
}

fadev_status fadev_round_f64(const double *x, double *out, size_t n, const fadev_format *fmt, int mode,
                             uint64_t seed, uint64_t stream, uint64_t index_offset) {
    return round_any(x, NULL, out, n, fmt, mode, seed, stream, index_offset);
}

fadev_status fadev_round_f32(const float *x, double *out, size_t n, const fadev_format *fmt, int mode,
                             uint64_t seed, uint64_t stream, uint64_t index_offset) {
    return round_any(NULL, x, out, n, fmt, mode, seed, stream, index_offset);
}

/* --- bit patterns: sign | exponent field (bias 1 - emin) | precision - 1 fraction bits --- */

static uint64_t encode_one(double v, const fadev_format *f, int exponent_bits) {
    int frac_bits = f->precision - 1;
    uint64_t u = fadev_bits_of(v);
    uint64_t sign = (u >> 63) << (exponent_bits + frac_bits);
    uint64_t all_ones_field = ((1ull << exponent_bits) - 1) << frac_bits;
    if (isnan(v)) {
        /* quiet NaN: top fraction bit (IEEE formats); all ones (formats without inf, e.g. E4M3FN) */
        uint64_t frac = f->has_inf ? (frac_bits ? 1ull << (frac_bits - 1) : 0) : (1ull << frac_bits) - 1;
        return sign | all_ones_field | frac;
    }
    if (isinf(v)) return sign | all_ones_field;
    double a = fabs(v);
    if (a == 0) return sign;
    int e;
    double m = frexp(a, &e); /* a = m * 2^e, 0.5 <= m < 1 */
    e -= 1;
    if (e < f->emin) { /* subnormal: fraction = a / 2^(emin - p + 1) */
        return sign | (uint64_t)ldexp(a, frac_bits - f->emin);
    }
    uint64_t field = (uint64_t)(e + 1 - f->emin);
    uint64_t frac = (uint64_t)ldexp(2.0 * m - 1.0, frac_bits);
    return sign | (field << frac_bits) | frac;
}

static double decode_one(uint64_t b, const fadev_format *f, int exponent_bits) {
    int frac_bits = f->precision - 1;
    uint64_t frac = b & ((1ull << frac_bits) - 1);
    uint64_t field = (b >> frac_bits) & ((1ull << exponent_bits) - 1);
    int negative = (int)((b >> (frac_bits + exponent_bits)) & 1);
    double v;
    if (f->has_inf && field == (1ull << exponent_bits) - 1) {
        v = frac ? NAN : INFINITY;
    } else if (field == 0) {
        v = f->subnormals ? ldexp((double)frac, f->emin - frac_bits) : (frac ? NAN : 0.0);
    } else {
        v = ldexp(1.0 + ldexp((double)frac, -frac_bits), (int)field - 1 + f->emin);
        if (v > f->largest) v = NAN; /* codes above the largest finite (E4M3FN's S.1111.111) */
    }
    return negative ? -v : v;
}

/* 1 if the layout has a code for NaN: IEEE-style formats use the all-ones exponent field with a nonzero
 * fraction (none when p = 1: the one code there is inf); formats without inf use all ones, which is NaN
 * only if it lies above `largest` (E4M3FN: yes; OCP MX float6/float4 "fn" formats: no NaN at all). */
static int has_nan_code(const fadev_format *f, int exponent_bits) {
    if (f->has_inf) return f->precision > 1;
    long all_ones_field = (1L << exponent_bits) - 1;
    long top_field = (long)f->emax + 1 - f->emin;
    return all_ones_field > top_field || f->largest < ldexp(2.0 - ldexp(1.0, 1 - f->precision), f->emax);
}

static fadev_status check_width(const fadev_format *fmt, int width, int *exponent_bits) {
    int total;
    if (width != 1 && width != 2 && width != 4 && width != 8) return FADEV_ERR_INVALID_ARGUMENT;
    fadev_format_layout(fmt, exponent_bits, &total);
    if (total > 8 * width) return FADEV_ERR_NOT_REPRESENTABLE;
    return FADEV_OK;
}

fadev_status fadev_to_bits(const double *x, void *bits, int width, size_t n, const fadev_format *fmt) {
    int k;
    fadev_status st = check_width(fmt, width, &k);
    if (st != FADEV_OK) return st;
    int nan_ok = has_nan_code(fmt, k);
    for (size_t i = 0; i < n; i++) {
        double v = fadev_round_one(x[i], fmt, FADEV_ROUND_NEAREST_EVEN, 0);
        if (!nan_ok && isnan(v)) return FADEV_ERR_INVALID_ARGUMENT; /* the format has no NaN code */
        uint64_t b = encode_one(v, fmt, k);
        switch (width) {
        case 1: ((uint8_t *)bits)[i] = (uint8_t)b; break;
        case 2: ((uint16_t *)bits)[i] = (uint16_t)b; break;
        case 4: ((uint32_t *)bits)[i] = (uint32_t)b; break;
        default: ((uint64_t *)bits)[i] = b; break;
        }
    }
    return FADEV_OK;
}

fadev_status fadev_from_bits(const void *bits, int width, double *out, size_t n, const fadev_format *fmt) {
    int k;
    fadev_status st = check_width(fmt, width, &k);
    if (st != FADEV_OK) return st;
    for (size_t i = 0; i < n; i++) {
        uint64_t b;
        switch (width) {
        case 1: b = ((const uint8_t *)bits)[i]; break;
        case 2: b = ((const uint16_t *)bits)[i]; break;
        case 4: b = ((const uint32_t *)bits)[i]; break;
        default: b = ((const uint64_t *)bits)[i]; break;
        }
        out[i] = decode_one(b, fmt, k);
    }
    return FADEV_OK;
}

fadev_status fadev_count_representable(const double *x, size_t n, const fadev_format *fmt, size_t *count) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) {
        double r = fadev_round_one(x[i], fmt, FADEV_ROUND_NEAREST_EVEN, 0);
        c += (r == x[i]) || (isnan(r) && isnan(x[i]));
    }
    *count = c;
    return FADEV_OK;
}
