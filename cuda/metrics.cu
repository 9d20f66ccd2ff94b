/* Deviation metrics on device arrays: the GPU twins of csrc/metrics.c (same fields, same definitions, same
 * NaN/inf rules; that file's top comment is the spec).
 *
 *   fadev_cuda_deviation_stats(test, ref, n): d_i = test_i - ref_i in fp64, then max |d|, mean d,
 *     std d (ddof 0), mean |d|, rmse, rel_l2 = ||d|| / ||ref||, max |d_i| / |ref_i|, counts of NaN / inf.
 *     Pass 1: each thread classifies its elements (metrics.c's chunk_careful) and keeps Neumaier sums of
 *     d sd, |d sd|, (d sd)^2, (ref sr)^2 over finite d; blocks combine them in a fixed tree (cub::BlockReduce)
 *     and the host adds the block results in block order, so the bits depend only on n. If max |d| or
 *     max |ref| lies outside [2^-448, 2^448], pass 1 is redone with sd, sr the powers of two metrics.c picks.
 *     Pass 2 (every d finite): sums of e = d sd - mean and e^2, M2 = sum e^2 - (sum e)^2 / n (corrected
 *     two-pass). Sums differ in order from the CPU's, so results agree within rounding, not bit for bit.
 *   fadev_cuda_wasserstein(a, n_a, b, n_b): W1 = integral_0^1 |Q_a(u) - Q_b(u)| du, exactly as metrics.c's
 *     sort path. Both inputs are mapped to keys whose unsigned order is IEEE total order (key_of below:
 *     -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN; cub sorts doubles with -0 == +0, so we sort the
 *     keys), sorted with cub::DeviceRadixSort. With L = lcm(n_a, n_b), wa = L / n_a, wb = L / n_b the u-axis
 *     is cut at every a-breakpoint i wa and b-breakpoint j wb; each piece [p, next) is computed on its own:
 *     i = p / wa, j = p / wb, len = min((i+1) wa, (j+1) wb) - p, term = len |a_(i) - b_(j)| scale -- one
 *     thread per a-breakpoint, and one per b-breakpoint that is not also an a-breakpoint. These are the
 *     CPU walk's terms exactly; they are summed (compensated) in another order. W1 = sum / L / scale, NaN if
 *     either input holds a NaN, scale as metrics.c (keeps the sum below overflow).
 *   fadev_cuda_ulp_error(test, ref, n, fmt, out): out_i = |test_i - ref_i| / ulp(ref_i), metrics.c's
 *     ulp_error_one with its ldexp replaced by exact power-of-two products: bit-identical, NaN payloads
 *     included (a NaN test propagates |test| quieted, as x86 does).
 * Every pointer is a device pointer; everything runs on the legacy default stream and synchronises. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <cub/cub.cuh>

#include "common.cuh"
#include "../csrc/deviation.h"
#include "../csrc/round.h"

namespace {

constexpr int THREADS = 256;
constexpr size_t MAX_BLOCKS = 1024; /* fixed, so the combination order (and the bits) depend on n only */
constexpr uint64_t SIGN = 0x8000000000000000ull;

typedef unsigned long long u64;
__extension__ typedef unsigned __int128 u128;

__host__ __device__ __forceinline__ bool finite_(double x) {
    return (fadev_bits_of(x) & 0x7FF0000000000000ull) != 0x7FF0000000000000ull;
}
__host__ __device__ __forceinline__ bool nan_(double x) { return x != x; }
__host__ __device__ __forceinline__ bool inf_(double x) { return (fadev_bits_of(x) << 1) == 0xFFE0000000000000ull; }

/* ------------------------------------------------------------ compensated sums (deviation.h) */

struct nsum_combine {
    __host__ __device__ __forceinline__ nsum operator()(nsum a, const nsum &b) const {
        nadd_sum(&a, b);
        return a;
    }
};

/* A host allocation freed when it leaves scope. */
template <typename T> struct host_buffer {
    T *ptr = nullptr;
    host_buffer() = default;
    host_buffer(const host_buffer &) = delete;
    host_buffer &operator=(const host_buffer &) = delete;
    ~host_buffer() { free(ptr); }
    fadev_status alloc(size_t count) {
        ptr = (T *)malloc((count ? count : 1) * sizeof(T));
        return ptr ? FADEV_OK : fadev_cuda_fail_msg(FADEV_ERR_NO_MEMORY, "metrics (cuda): host allocation failed");
    }
};

/* Number of blocks of a grid-stride pass over n elements. */
unsigned blocks_for(size_t n) {
    size_t b = (n + THREADS - 1) / THREADS;
    return (unsigned)(b < MAX_BLOCKS ? b : MAX_BLOCKS);
}

/* ------------------------------------------------------------ deviation */

struct dev_combine_op {
    __host__ __device__ dev_part operator()(dev_part a, const dev_part &b) const {
        dev_combine(&a, &b);
        return a;
    }
};

/* metrics.c's chunk_careful for one element. */
__host__ __device__ __forceinline__ void dev_accumulate(dev_part &p, double t, double r, double sd, double sr) {
    double d = t - r;
    if (nan_(t) || nan_(r))
        p.n_nan_in++;
    else if (inf_(t) || inf_(r))
        p.n_inf_in++;
    if (inf_(r)) p.n_ref_inf++;
    if (r != 0) {
        double rel = fabs(d) / fabs(r);
        p.n_rel++;
        if (nan_(rel))
            p.rel_nan = 1;
        else if (rel > p.max_rel)
            p.max_rel = rel;
    }
    if (nan_(d)) {
        p.n_nan_d++;
        return;
    }
    if (inf_(d)) {
        if (d > 0)
            p.n_pos_inf_d++;
        else
            p.n_neg_inf_d++;
        return;
    }
    double ds = d * sd, rs = r * sr;
    nadd(&p.sum_d, ds);
    nadd(&p.sum_abs, fabs(ds));
    nadd(&p.sum_sq, ds * ds);
    nadd(&p.sum_ref_sq, rs * rs);
    if (fabs(d) > p.max_abs) p.max_abs = fabs(d);
    if (fabs(r) > p.max_ref) p.max_ref = fabs(r);
    p.n_finite++;
}

/* Pass 1 over a grid-stride range; one dev_part per block. */
__global__ void __launch_bounds__(THREADS) deviation_kernel(const double *test, const double *ref, size_t n,
                                                            double sd, double sr, dev_part *parts) {
    dev_part p = {};
    for (size_t i = blockIdx.x * (size_t)THREADS + threadIdx.x; i < n; i += (size_t)gridDim.x * THREADS)
        dev_accumulate(p, test[i], ref[i], sd, sr);
    typedef cub::BlockReduce<dev_part, THREADS> reduce_t;
    __shared__ typename reduce_t::TempStorage tmp;
    dev_part total = reduce_t(tmp).Reduce(p, dev_combine_op());
    if (threadIdx.x == 0) parts[blockIdx.x] = total;
}

struct spread_part {
    nsum dev1, dev2; /* sum (d sd - mean), sum (d sd - mean)^2 */
};

struct spread_combine {
    __host__ __device__ spread_part operator()(spread_part a, const spread_part &b) const {
        nadd_sum(&a.dev1, b.dev1);
        nadd_sum(&a.dev2, b.dev2);
        return a;
    }
};

/* Second pass (every d finite): deviations from the scaled mean. */
__global__ void __launch_bounds__(THREADS) spread_kernel(const double *test, const double *ref, size_t n, double sd,
                                                         double mean, spread_part *parts) {
    spread_part p = {{0, 0}, {0, 0}};
    for (size_t i = blockIdx.x * (size_t)THREADS + threadIdx.x; i < n; i += (size_t)gridDim.x * THREADS) {
        double e = (test[i] - ref[i]) * sd - mean;
        nadd(&p.dev1, e);
        nadd(&p.dev2, e * e);
    }
    typedef cub::BlockReduce<spread_part, THREADS> reduce_t;
    __shared__ typename reduce_t::TempStorage tmp;
    spread_part total = reduce_t(tmp).Reduce(p, spread_combine());
    if (threadIdx.x == 0) parts[blockIdx.x] = total;
}


/* ------------------------------------------------------------ Wasserstein */

/* Order-preserving keys: unsigned key order is IEEE total order. */
__host__ __device__ __forceinline__ u64 key_of(double x) {
    u64 u = fadev_bits_of(x);
    return u ^ ((u64)((int64_t)u >> 63) | SIGN);
}

__host__ __device__ __forceinline__ double value_of(u64 k) { return fadev_double_of(k & SIGN ? k ^ SIGN : ~k); }

__global__ void keys_kernel(const double *x, size_t n, u64 *keys) {
    for (size_t i = blockIdx.x * (size_t)THREADS + threadIdx.x; i < n; i += (size_t)gridDim.x * THREADS)
        keys[i] = key_of(x[i]);
}

/* The term of piece u: u < n_a, the piece starting at a-breakpoint u; u >= n_a, the piece starting at
 * b-breakpoint u - n_a unless an a-breakpoint is there too (then 0: that piece is counted once, as u < n_a).
 * U holds positions on the u-axis in units of 1/L; ka, kb are the sorted keys. */
template <typename U>
__host__ __device__ __forceinline__ bool w1_term(const u64 *ka, size_t n_a, const u64 *kb, U wa, U wb,
                                                 double scale, size_t u, double *term) {
    size_t i, j;
    U pos;
    if (u < n_a) {
        i = u;
        pos = (U)i * wa;
        j = (size_t)(pos / wb);
    } else {
        j = u - n_a;
        pos = (U)j * wb;
        if (pos % wa == 0) return false;
        i = (size_t)(pos / wa);
    }
    U next_a = (U)(i + 1) * wa, next_b = (U)(j + 1) * wb;
    uint64_t len = (uint64_t)((next_a < next_b ? next_a : next_b) - pos); /* < 2^64, as metrics.c */
    *term = (double)len * (fabs(value_of(ka[i]) - value_of(kb[j])) * scale);
    return true;
}

template <typename U>
__global__ void __launch_bounds__(THREADS) w1_kernel(const u64 *ka, size_t n_a, const u64 *kb, size_t n_b, U wa,
                                                     U wb, double scale, nsum *parts) {
    nsum sum = {0, 0};
    for (size_t u = blockIdx.x * (size_t)THREADS + threadIdx.x; u < n_a + n_b; u += (size_t)gridDim.x * THREADS) {
        double term;
        if (w1_term(ka, n_a, kb, wa, wb, scale, u, &term)) nadd(&sum, term);
    }
    typedef cub::BlockReduce<nsum, THREADS> reduce_t;
    __shared__ typename reduce_t::TempStorage tmp;
    nsum block = reduce_t(tmp).Reduce(sum, nsum_combine());
    if (threadIdx.x == 0) parts[blockIdx.x] = block;
}

u128 gcd128(u128 x, u128 y) {
    while (y) {
        u128 t = x % y;
        x = y;
        y = t;
    }
    return x;
}

/* Sorts the keys of x (n values) into ascending total order; *sorted points into keys or alt. */
fadev_status sort_keys(const double *x, size_t n, u64 *keys, u64 *alt, void *temp, size_t temp_bytes,
                       const u64 **sorted) {
    keys_kernel<<<blocks_for(n), THREADS>>>(x, n, keys);
    CUDA_TRY(cudaGetLastError());
    cub::DoubleBuffer<u64> buf(keys, alt);
    CUDA_TRY(cub::DeviceRadixSort::SortKeys(temp, temp_bytes, buf, n));
    *sorted = buf.Current();
    return FADEV_OK;
}

/* ------------------------------------------------------------ ULP error */

/* metrics.c's ulp_error_one. ldexp(d, -q) is needed only for q = 1023 (2^-1023 is an exact subnormal
 * factor: one rounding) and q <= -1024 (d 2^1023 is exact or overflows exactly when d 2^-q does, then one
 * rounding); q lies in [-1074, 1023] for every valid format. */
__host__ __device__ __forceinline__ double ulp_error_one(double t, double r, int emin, int p, int q_below) {
    uint64_t ur = fadev_bits_of(r);
    int biased = (int)((ur >> 52) & 0x7FF);
    if (biased == 0x7FF) return fadev_double_of(0x7FF8000000000000ull); /* C's NAN */
    if (nan_(t)) return fadev_double_of((fadev_bits_of(t) | 0x0008000000000000ull) & ~SIGN);
    double d = fabs(t - r);
    int e = biased - 1023;
    int q = biased && e >= emin ? e - p + 1 : q_below;
    if (q >= -1023 && q <= 1022) return d * fadev_double_of((uint64_t)(1023 - q) << 52);
    if (q == 1023) return d * fadev_double_of(1ull << 51);
    if (q >= -1074 && q <= -1024) return (d * 0x1p1023) * fadev_double_of((uint64_t)(-q) << 52);
    return ldexp(d, -q);
}

__global__ void ulp_kernel(const double *test, const double *ref, size_t n, int emin, int p, int q_below,
                           double *out) {
    for (size_t i = blockIdx.x * (size_t)THREADS + threadIdx.x; i < n; i += (size_t)gridDim.x * THREADS)
        out[i] = ulp_error_one(test[i], ref[i], emin, p, q_below);
}

/* fadev_deviation_stats' steps (deviation.h) around two sweeps over the data: pass1(sd, sr, &part)
 * (repeated scaled when squares could overflow or underflow) and pass2(sd, mean, &spread). */
template <typename Pass1, typename Pass2>
fadev_status deviation_from_passes(size_t n, Pass1 pass1, Pass2 pass2, fadev_deviation *out) {
    dev_part tot;
    double sd = 1.0, sr = 1.0;
    int kd = 0, kr = 0;
    FADEV_TRY(pass1(sd, sr, &tot));
    if (dev_rescale(&tot, &sd, &sr, &kd, &kr)) FADEV_TRY(pass1(sd, sr, &tot));
    if (dev_finish_nonfinite(&tot, n, out)) return FADEV_OK;
    const double mean_s = nval(tot.sum_d) / (double)n;
    spread_part sp;
    FADEV_TRY(pass2(sd, mean_s, &sp));
    dev_finish_finite(&tot, n, mean_s, sp.dev1, sp.dev2, sd, kd, kr, out);
    return FADEV_OK;
}

/* metrics.c's w1_sorted around the walk: ends = the sorted keys a_(0), a_(n_a-1), b_(0), b_(n_b-1);
 * walk(wa, wb, scale, &sum) adds up every piece's term. */
template <typename Walk>
fadev_status w1_from_sorted(const u64 ends[4], size_t n_a, size_t n_b, Walk walk, double *out) {
    const double a0 = value_of(ends[0]), a1 = value_of(ends[1]), b0 = value_of(ends[2]), b1 = value_of(ends[3]);
    if (nan_(a0) || nan_(a1) || nan_(b0) || nan_(b1)) { /* NaNs sort to the ends */
        *out = NAN;
        return FADEV_OK;
    }
    const u128 g = gcd128(n_a, n_b);
    const u128 L = (u128)n_a / g * n_b;
    const double dl = (double)L;
    double scale = 1.0;
    double top = fmax(fmax(fabs(a0), fabs(a1)), fmax(fabs(b0), fabs(b1)));
    if (finite_(top) && top > 0 && ilogb(top) + ilogb(dl) > 1000) /* sum <= 2 * top * L */
        scale = ldexp(1.0, 1000 - ilogb(top) - ilogb(dl));
    nsum total = {0, 0};
    FADEV_TRY(walk(L / n_a, L / n_b, scale, &total));
    *out = nval(total) / dl / scale;
    return FADEV_OK;
}

} /* namespace */

extern "C" fadev_status fadev_cuda_deviation_stats(const double *test, const double *ref, size_t n,
                                                   fadev_deviation *out) {
    if (!test || !ref || !out || n == 0) return FADEV_ERR_INVALID_ARGUMENT;
    FADEV_TRY(fadev_cuda_require_device());
    const unsigned blocks = blocks_for(n);
    device_buffer<dev_part> d_parts;
    device_buffer<spread_part> d_spread;
    host_buffer<dev_part> h_parts;
    host_buffer<spread_part> h_spread;
    FADEV_TRY(d_parts.alloc(blocks, "fadev_cuda_deviation_stats: cudaMalloc"));
    FADEV_TRY(d_spread.alloc(blocks, "fadev_cuda_deviation_stats: cudaMalloc"));
    FADEV_TRY(h_parts.alloc(blocks));
    FADEV_TRY(h_spread.alloc(blocks));
    /* block results are combined on the host, in block order */
    auto pass1 = [&](double sd, double sr, dev_part *total) -> fadev_status {
        deviation_kernel<<<blocks, THREADS>>>(test, ref, n, sd, sr, d_parts.ptr);
        CUDA_TRY(cudaGetLastError());
        CUDA_TRY(cudaMemcpy(h_parts.ptr, d_parts.ptr, blocks * sizeof(dev_part), cudaMemcpyDeviceToHost));
        *total = h_parts.ptr[0];
        for (unsigned b = 1; b < blocks; b++) dev_combine(total, &h_parts.ptr[b]);
        return FADEV_OK;
    };
    auto pass2 = [&](double sd, double mean, spread_part *total) -> fadev_status {
        spread_kernel<<<blocks, THREADS>>>(test, ref, n, sd, mean, d_spread.ptr);
        CUDA_TRY(cudaGetLastError());
        CUDA_TRY(cudaMemcpy(h_spread.ptr, d_spread.ptr, blocks * sizeof(spread_part), cudaMemcpyDeviceToHost));
        *total = h_spread.ptr[0];
        for (unsigned b = 1; b < blocks; b++) *total = spread_combine()(*total, h_spread.ptr[b]);
        return FADEV_OK;
    };
    FADEV_TRY(deviation_from_passes(n, pass1, pass2, out));
    return fadev_cuda_finish("fadev_cuda_deviation_stats");
}

extern "C" fadev_status fadev_cuda_wasserstein(const double *a, size_t n_a, const double *b, size_t n_b,
                                               double *out) {
    if (!a || !b || !out || n_a == 0 || n_b == 0) return FADEV_ERR_INVALID_ARGUMENT;
    if (n_a >= ((size_t)1 << 59) || n_b >= ((size_t)1 << 59)) return FADEV_ERR_OVERFLOW;
    FADEV_TRY(fadev_cuda_require_device());
    device_buffer<u64> keys, alt;
    FADEV_TRY(keys.alloc(n_a + n_b, "fadev_cuda_wasserstein: cudaMalloc keys"));
    FADEV_TRY(alt.alloc(n_a + n_b, "fadev_cuda_wasserstein: cudaMalloc keys"));
    size_t temp_a = 0, temp_b = 0;
    {
        cub::DoubleBuffer<u64> qa(keys.ptr, alt.ptr), qb(keys.ptr + n_a, alt.ptr + n_a);
        CUDA_TRY(cub::DeviceRadixSort::SortKeys(nullptr, temp_a, qa, n_a));
        CUDA_TRY(cub::DeviceRadixSort::SortKeys(nullptr, temp_b, qb, n_b));
    }
    const size_t temp_bytes = temp_a > temp_b ? temp_a : temp_b;
    device_buffer<unsigned char> temp;
    FADEV_TRY(temp.alloc(temp_bytes, "fadev_cuda_wasserstein: cudaMalloc sort scratch"));
    const u64 *sa = nullptr, *sb = nullptr;
    FADEV_TRY(sort_keys(a, n_a, keys.ptr, alt.ptr, temp.ptr, temp_bytes, &sa));
    FADEV_TRY(sort_keys(b, n_b, keys.ptr + n_a, alt.ptr + n_a, temp.ptr, temp_bytes, &sb));
    u64 ends[4];
    CUDA_TRY(cudaMemcpy(&ends[0], sa, sizeof(u64), cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(&ends[1], sa + n_a - 1, sizeof(u64), cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(&ends[2], sb, sizeof(u64), cudaMemcpyDeviceToHost));
    CUDA_TRY(cudaMemcpy(&ends[3], sb + n_b - 1, sizeof(u64), cudaMemcpyDeviceToHost));
    const unsigned blocks = blocks_for(n_a + n_b);
    device_buffer<nsum> d_parts;
    host_buffer<nsum> h_parts;
    FADEV_TRY(d_parts.alloc(blocks, "fadev_cuda_wasserstein: cudaMalloc"));
    FADEV_TRY(h_parts.alloc(blocks));
    auto walk = [&](u128 wa, u128 wb, double scale, nsum *total) -> fadev_status {
        if (wa * n_a <= (u128)UINT64_MAX) /* L fits 64 bits: cheaper divisions */
            w1_kernel<uint64_t><<<blocks, THREADS>>>(sa, n_a, sb, n_b, (uint64_t)wa, (uint64_t)wb, scale, d_parts.ptr);
        else
            w1_kernel<u128><<<blocks, THREADS>>>(sa, n_a, sb, n_b, wa, wb, scale, d_parts.ptr);
        CUDA_TRY(cudaGetLastError());
        CUDA_TRY(cudaMemcpy(h_parts.ptr, d_parts.ptr, blocks * sizeof(nsum), cudaMemcpyDeviceToHost));
        for (unsigned blk = 0; blk < blocks; blk++) nadd_sum(total, h_parts.ptr[blk]);
        return FADEV_OK;
    };
    FADEV_TRY(w1_from_sorted(ends, n_a, n_b, walk, out));
    return fadev_cuda_finish("fadev_cuda_wasserstein");
}

/* n = 0 is allowed (nothing to do), as fadev_ulp_error allows it. */
extern "C" fadev_status fadev_cuda_ulp_error(const double *test, const double *ref, size_t n, const fadev_format *fmt,
                                             double *out) {
    if (!fmt || (n && (!test || !ref || !out))) return FADEV_ERR_INVALID_ARGUMENT;
    FADEV_TRY(fadev_cuda_require_device());
    if (n == 0) return FADEV_OK;
    const int q_below = fmt->subnormals ? fmt->emin - fmt->precision + 1 : fmt->emin;
    size_t blocks = (n + THREADS - 1) / THREADS;
    if (blocks > 65535) blocks = 65535;
    ulp_kernel<<<(unsigned)blocks, THREADS>>>(test, ref, n, fmt->emin, fmt->precision, q_below, out);
    CUDA_TRY(cudaGetLastError());
    return fadev_cuda_finish("fadev_cuda_ulp_error");
}
