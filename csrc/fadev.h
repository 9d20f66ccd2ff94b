/* fadev public C API: formats and rounding, metrics, attention kernels.
 *
 * Every public function returns fadev_status (FADEV_OK = 0) and never exits or aborts.
 * Arrays are raw pointers to contiguous float64 (or float32 where noted) data; the Python
 * binding (module.c) validates, converts and releases the GIL before calling in here.
 * All arithmetic that must be bit-reproducible is compiled with -ffp-contract=off. */
#ifndef FADEV_H
#define FADEV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fadev_status {
    FADEV_OK = 0,
    FADEV_ERR_INVALID_FORMAT,   /* a format's parameters are out of range */
    FADEV_ERR_INVALID_MODE,     /* unknown rounding mode */
    FADEV_ERR_INVALID_ARGUMENT, /* a size, tile or option is out of range */
    FADEV_ERR_SHAPE,            /* shapes do not agree */
    FADEV_ERR_OVERFLOW,         /* a size computation overflows size_t */
    FADEV_ERR_NO_MEMORY,        /* an allocation failed */
    FADEV_ERR_THREAD,           /* a worker thread could not be started */
    FADEV_ERR_NOT_REPRESENTABLE,/* bit-pattern conversion asked of a format with no bit layout */
    FADEV_ERR_CUDA,             /* a CUDA runtime call failed (see fadev_cuda_last_error) */
    FADEV_ERR_NO_CUDA,          /* the module was built without CUDA, or no device is present */
    FADEV_STATUS_COUNT
} fadev_status;

const char *fadev_status_string(fadev_status status);

/* ---------------------------------------------------------------- formats */

typedef enum fadev_overflow {
    FADEV_OVERFLOW_INF = 0,      /* IEEE: a magnitude rounded above `largest` becomes +-inf */
    FADEV_OVERFLOW_NAN = 1,      /* becomes NaN (OCP E4M3FN, as ml_dtypes converts) */
    FADEV_OVERFLOW_SATURATE = 2  /* clamps to +-largest (and +-inf inputs too) */
} fadev_overflow;

typedef enum fadev_rounding {
    FADEV_ROUND_NEAREST_EVEN = 0, /* round to nearest, ties to even significand */
    FADEV_ROUND_TOWARD_ZERO = 1,  /* truncate; a finite value never becomes inf or NaN (IEEE) */
    FADEV_ROUND_STOCHASTIC = 2    /* up with probability (|x| - lo) / gap, Philox bits per element */
} fadev_rounding;

/* A binary floating-point format. Values are carried as float64 numbers exactly representable
 * in the format. Normal numbers are m * 2^e with 1 <= m < 2 (p significand bits), emin <= e <= emax. */
typedef struct fadev_format {
    int32_t precision;  /* p: significand bits including the implicit one, 1..53 */
    int32_t emin;       /* exponent of the smallest normal number 2^emin */
    int32_t emax;       /* exponent of the largest binade */
    int32_t subnormals; /* 1: gradual underflow below 2^emin; 0: values below 2^emin round to 0 or 2^emin */
    int32_t has_inf;    /* 1: the format has infinities (an inf input stays inf) */
    int32_t overflow;   /* fadev_overflow: what a magnitude rounded above `largest` becomes */
    double largest;     /* largest finite magnitude (OCP E4M3FN: 448, not 480) */
} fadev_format;

/* Fill *fmt from parameters; largest <= 0 means the full top binade (2 - 2^(1-p)) * 2^emax. */
fadev_status fadev_format_make(int precision, int emin, int emax, int subnormals, int has_inf,
                               int overflow, double largest, fadev_format *fmt);
/* Bit layout of an IEEE-style encoding of fmt: sign, exponent_bits, precision - 1 fraction bits. */
fadev_status fadev_format_layout(const fadev_format *fmt, int *exponent_bits, int *total_bits);

/* out[i] = round(x[i]) to fmt; x and out may alias. seed and index_offset key the stochastic
 * generator: element i draws from Philox(counter = (index_offset + i, stream), key = seed). */
fadev_status fadev_round_f64(const double *x, double *out, size_t n, const fadev_format *fmt,
                             int mode, uint64_t seed, uint64_t stream, uint64_t index_offset);
fadev_status fadev_round_f32(const float *x, double *out, size_t n, const fadev_format *fmt,
                             int mode, uint64_t seed, uint64_t stream, uint64_t index_offset);

/* Bit patterns: encode values (must already be exact in fmt, else rounded to nearest even first)
 * into width-byte unsigned integers (width = 1, 2, 4 or 8), or decode them back to float64.
 * fadev_to_bits returns FADEV_ERR_INVALID_ARGUMENT for a NaN in a format without a NaN code (OCP MX fn). */
fadev_status fadev_to_bits(const double *x, void *bits, int width, size_t n, const fadev_format *fmt);
fadev_status fadev_from_bits(const void *bits, int width, double *out, size_t n, const fadev_format *fmt);

/* count of elements of x that are exactly representable in fmt (NaN counts as representable). */
fadev_status fadev_count_representable(const double *x, size_t n, const fadev_format *fmt, size_t *count);

/* ---------------------------------------------------------------- precision policy */

/* The format of every intermediate of attention (docs/design.md, "Precision policy").
 * Accumulators hold the running sum inside one reduction; stored values are tensors between operations. */
typedef struct fadev_policy {
    fadev_format input;       /* stored: Q, K, V rounded on entry */
    fadev_format score_acc;   /* accumulator: each Q.K dot product, every partial sum rounded */
    fadev_format score;       /* stored: S = scale * QK^T (dot product rounded, then the scaled value) */
    fadev_format softmax;     /* stored: S - m and exp(S - m) */
    fadev_format sum_acc;     /* accumulator: each row sum of exp(S - m) within one block */
    fadev_format stats;       /* stored: row sum l, its update a*l + rowsum, LSE = m + log l */
    fadev_format rescale;     /* stored, flash only: a = exp(m_old - m_new) and the difference */
    fadev_format p;           /* stored: P as fed to the P.V product */
    fadev_format pv_acc;      /* accumulator: each P.V dot product within one block */
    fadev_format out_acc;     /* stored, flash only: running O between K/V blocks */
    fadev_format state_out;   /* stored, flash kv_outer only: O as written to memory between K/V blocks */
    fadev_format state_stats; /* stored, flash kv_outer only: l as written to memory between K/V blocks */
    fadev_format out;         /* stored: the output */
    int32_t rounding;         /* fadev_rounding used at every stage */
    uint64_t seed;            /* key of the stochastic-rounding generator */
} fadev_policy;

/* Backward stages (docs/numerics.md, "Backward"); used with the forward fadev_policy, whose stages govern
 * the recomputation of S and P and whose rounding mode and seed apply here too. */
typedef struct fadev_policy_backward {
    fadev_format bwd_p;     /* stored: recomputed P as fed to the dV product */
    fadev_format dsoft_p;   /* stored: recomputed P as the softmax backward dS = P (dP - D) reads it */
    fadev_format dp_acc;    /* accumulator: each dP = dO.V dot product */
    fadev_format dp;        /* stored: dP after its product */
    fadev_format delta_acc; /* accumulator: D = rowsum(dO * O) (flash) / sum_j P dP (baseline) */
    fadev_format dsoft;     /* stored: D, dP - D, P * (dP - D) (and scale * P * (dP - D) when ds_scaled) */
    fadev_format ds;        /* stored: dS as fed to the dQ and dK products */
    fadev_format grad_acc;  /* accumulator: each dV, dK, dQ dot product within one block */
    fadev_format dq_acc;    /* stored: dQ accumulated across K/V blocks */
    fadev_format dkv_acc;   /* stored: dK, dV accumulated across query blocks and the heads of a group */
    fadev_format grad;      /* stored: the returned dq, dk, dv */
    int32_t ds_scaled;      /* 1: the scale multiplies each dS before R_ds (xformers); 0: the dQ, dK sums (FA2) */
} fadev_policy_backward;

typedef enum fadev_loop_order { FADEV_Q_OUTER = 0, FADEV_KV_OUTER = 1 } fadev_loop_order;
typedef enum fadev_normalize { FADEV_DEFERRED = 0, FADEV_EAGER = 1 } fadev_normalize;
typedef enum fadev_exp_form { FADEV_EXP = 0, FADEV_EXP2 = 1 } fadev_exp_form;

/* Shapes and options of one attention call. q: (batch, heads, seq_q, dim); k, v: (batch, heads_kv,
 * seq_kv, dim); out: like q; lse: (batch, heads, seq_q). All contiguous float64. */
typedef struct fadev_late_outputs fadev_late_outputs; /* below */

typedef struct fadev_attention_params {
    int64_t batch;      /* B */
    int64_t heads;      /* H: query heads */
    int64_t heads_kv;   /* H_kv: key/value heads; heads % heads_kv == 0 (grouped-query) */
    int64_t seq_q;      /* Nq: query rows */
    int64_t seq_kv;     /* Nk: key/value rows */
    int64_t dim;        /* D: head dimension, 1..256 */
    double scale;       /* multiplies Q K^T (1/sqrt(D) by default, chosen by the caller) */
    int32_t causal;     /* 1: query i sees keys j <= i + seq_kv - seq_q (bottom-right aligned) */
    int32_t block_q;    /* flash: Br, query rows per block (>= 1) */
    int32_t block_kv;   /* flash: Bc, key/value rows per block (>= 1) */
    int32_t loop_order; /* flash: fadev_loop_order */
    int32_t normalize;  /* flash: fadev_normalize */
    int32_t exp_form;   /* flash: fadev_exp_form */
    int32_t asynchronous; /* CUDA emulated and golden kernels: 0 (the default) the call synchronises the device before it returns;
                             1 its kernels stay queued on the legacy default stream (PyTorch's default stream) and it
                             returns after the launches, as a CUDA library call. The CPU ignores it. */
    const fadev_late_outputs *late; /* CUDA emulated forward: NULL, or where its out and lse come from (below; the
                                       entry's out and lse are then NULL). The CPU ignores it. */
} fadev_attention_params;

/* A CUDA emulated forward's outputs, asked for once its first kernel (the inputs' rounding) is queued: fill(ctx,
 * ptrs) sets ptrs[0] to out and ptrs[1] to lse (device pointers), so that the caller allocates its results while the
 * GPU rounds the inputs, not before the GPU has work (fadev.cuda_plans' replay: H200, 12-40 us of a call's host time
 * before its first kernel, benchmarks/README.md). A status other than FADEV_OK ends the call with that status; the
 * rounding already queued writes only the call's own scratch. */
struct fadev_late_outputs {
    fadev_status (*fill)(void *ctx, void **ptrs);
    void *ctx;
};

/* ---------------------------------------------------------------- metrics (metrics.c) */

/* Deviation of `test` from `ref`, d = test - ref in fp64 (NaN/inf rules: metrics.c, top comment). */
typedef struct fadev_deviation {
    double max_abs;   /* max |d| */
    double mean_diff; /* mean of d */
    double std_diff;  /* population (ddof = 0) standard deviation of d */
    double mean_abs;  /* mean of |d| */
    double rmse;      /* sqrt(mean of d^2) */
    double rel_l2;    /* ||d||_2 / ||ref||_2; 0 when d == 0, inf when ref == 0 != d */
    double max_rel;   /* max of |d| / |ref| over ref != 0; NaN when every ref is 0 */
    uint64_t n;       /* elements */
    uint64_t n_nan;   /* elements where test or ref is NaN */
    uint64_t n_inf;   /* elements where neither is NaN and test or ref is +-inf */
} fadev_deviation;

/* All deviation metrics of test vs ref (n >= 1 values each) in one pass; identical bits for any
 * thread count (compensated sums over fixed chunks combined in chunk order). */
fadev_status fadev_deviation_stats(const double *test, const double *ref, size_t n, fadev_deviation *out);

typedef enum fadev_w1_method {
    FADEV_W1_AUTO = 0, /* counting when both inputs fit bf16 or fp16 and n_a + n_b >= 65536; else nothing is
                          computed and *method_used = FADEV_W1_SORT asks the caller to sort and call again */
    FADEV_W1_SORT = 1, /* a and b already sorted ascending (NaNs last, as np.sort leaves them): integrate
                          |Q_a(u) - Q_b(u)| over u in one O(n_a + n_b) walk */
    FADEV_W1_COUNT = 2 /* histogram by 16-bit pattern (O(n + 2^16)); FADEV_ERR_NOT_REPRESENTABLE if
                          some value is not a finite bf16 or fp16 number in both inputs */
} fadev_w1_method;

/* Exact Wasserstein-1 distance between the empirical distributions of a (n_a >= 1 values) and b
 * (n_b >= 1): the integral of |F_a - F_b|. *method_used receives FADEV_W1_SORT or FADEV_W1_COUNT. The sort
 * itself is the caller's (fadev.metrics uses NumPy's, faster than a radix sort of our own). */
fadev_status fadev_wasserstein(const double *a, size_t n_a, const double *b, size_t n_b, int method,
                               double *out, int *method_used);

/* out[i] = |test[i] - ref[i]| / ulp(ref[i]) with ulp(r) = 2^(max(e, emin) - p + 1), r in [2^e, 2^(e+1)),
 * fmt's p and emin (the binade rule extends past emax; below 2^emin without subnormals: 2^emin, as
 * fadev.ulp). NaN when test or ref is NaN or ref is +-inf. */
fadev_status fadev_ulp_error(const double *test, const double *ref, size_t n, const fadev_format *fmt,
                             double *out);
/* counts[k] = elements with ULP error in [k, k+1) for k < max_ulp, counts[max_ulp] = error >= max_ulp
 * (inf included); *n_nan = elements whose error is NaN. 1 <= max_ulp <= 2^20. */
fadev_status fadev_ulp_histogram(const double *test, const double *ref, size_t n, const fadev_format *fmt,
                                 size_t max_ulp, uint64_t *counts, uint64_t *n_nan);

/* ---------------------------------------------------------------- attention (baseline.c, flash.c) */

/* Attention forward under `policy`, operation by operation as docs/numerics.md specifies (one policy
 * and one tiling give one bit pattern, on any thread count). q (B, H, Nq, D), k and v (B, Hkv, Nk, D),
 * out (B, H, Nq, D), lse (B, H, Nq) or NULL; all contiguous float64. Baseline ignores the flash fields
 * of params (block_q, block_kv, loop_order, normalize, exp_form). Errors: FADEV_ERR_INVALID_ARGUMENT
 * (a size < 1, dim > 256, tiles < 1, an enum out of range, scale not finite, a NULL pointer, stochastic
 * rounding with Nq or Nk >= 2^21), FADEV_ERR_SHAPE (heads % heads_kv != 0), FADEV_ERR_INVALID_FORMAT,
 * FADEV_ERR_INVALID_MODE, FADEV_ERR_OVERFLOW (sizes), FADEV_ERR_NO_MEMORY. */
fadev_status fadev_baseline_attention(const double *q, const double *k, const double *v, double *out, double *lse,
                                      const fadev_attention_params *params, const fadev_policy *policy);
fadev_status fadev_flash_attention(const double *q, const double *k, const double *v, double *out, double *lse,
                                   const fadev_attention_params *params, const fadev_policy *policy);

/* ---------------------------------------------------------------- Hadamard rotation (hadamard.c) */

/* Rotate each of `rows` rows of x (rows x dim, contiguous) by the normalised Walsh-Hadamard transform:
 * forward (inverse = 0) out = H (signs * x) / sqrt(dim); inverse (inverse = 1) out = signs * (H x) / sqrt(dim),
 * H the Sylvester Hadamard matrix, computed with dim log2(dim) fp64 butterflies. signs: dim values, each
 * +1 or -1, or NULL for all +1. out is x itself or disjoint from it. FADEV_ERR_INVALID_ARGUMENT: a NULL
 * array, rows or dim 0, dim not a power of two, a sign not +-1, inverse not 0/1; FADEV_ERR_OVERFLOW. */
fadev_status fadev_hadamard_f64(const double *x, double *out, size_t rows, size_t dim, const double *signs,
                                int inverse);

/* ---------------------------------------------------------------- backward (backward.c) */

/* Attention backward under `policy` (it recomputes S and P; its rounding mode and seed apply to every
 * backward event) and `policy_backward`, operation by operation as docs/numerics.md "Backward" specifies
 * (one policy and one tiling give one bit pattern, on any thread count). q, out, dout, dq (B, H, Nq, D);
 * k, v, dk, dv (B, Hkv, Nk, D); lse (B, H, Nq); all contiguous float64. out and lse are the forward's
 * results (the baseline reads neither: it recomputes P and D_i as autograd does). params: as the
 * forward; flash uses block_q, block_kv and exp_form, both ignore loop_order and normalize. Errors as
 * the forward's, plus FADEV_ERR_INVALID_ARGUMENT for a NULL lse, dout, dq, dk, dv or policy_backward and
 * FADEV_ERR_INVALID_FORMAT for a backward format. */
fadev_status fadev_baseline_attention_backward(const double *q, const double *k, const double *v, const double *out,
                                               const double *lse, const double *dout, double *dq, double *dk,
                                               double *dv, const fadev_attention_params *params,
                                               const fadev_policy *policy,
                                               const fadev_policy_backward *policy_backward);
fadev_status fadev_flash_attention_backward(const double *q, const double *k, const double *v, const double *out,
                                            const double *lse, const double *dout, double *dq, double *dk, double *dv,
                                            const fadev_attention_params *params, const fadev_policy *policy,
                                            const fadev_policy_backward *policy_backward);

/* ---------------------------------------------------------------- ring attention (ring.c) */

typedef enum fadev_ring_layout {
    FADEV_RING_CONTIGUOUS = 0, /* rank r holds tokens [r N/W, (r+1) N/W) */
    FADEV_RING_ZIGZAG = 1,     /* 2W chunks; rank r holds chunks r and 2W-1-r */
    FADEV_RING_STRIPED = 2     /* token i on rank i mod W */
} fadev_ring_layout;

/* A ring of W ranks simulated on one device (ring.c, top comment: pieces, masks, merge order). */
typedef struct fadev_ring_params {
    int32_t world_size;         /* W >= 1; N % W == 0 (zigzag: N % 2W == 0) */
    int32_t layout;             /* fadev_ring_layout */
    int32_t allgather;          /* 1: K/V all-gathered, one flash call per query group, no merge (llama3) */
    fadev_format partial_out;   /* forward: each step's flash output as returned (the flash call's out) */
    fadev_format partial_lse;   /* forward: each step's LSE as returned */
    fadev_format merge;         /* forward: the arithmetic of the LSE merge (sigmoid rule) */
    fadev_format running_out;   /* forward: the running output as stored between hops */
    fadev_format running_lse;   /* forward: the running LSE as stored between hops (and returned) */
    fadev_format partial_grad;  /* backward: dq, dk, dv of each step's flash backward as returned */
    fadev_format dq_acc;        /* backward: dq accumulated across steps */
    fadev_format dkv_acc;       /* backward: dk, dv accumulated on the rank holding them */
    fadev_format dkv_transport; /* backward: dk, dv as sent between hops / reduce-scattered */
} fadev_ring_params;

/* Ring attention forward / backward (seq_q == seq_kv == N); params carries shapes, scale, causal and the
 * flash tiling of every step's call. Errors: FADEV_ERR_INVALID_ARGUMENT (W < 1, N not divisible as the
 * layout needs, layout out of range, seq_q != seq_kv, a NULL array) and those of the flash entry points. */
fadev_status fadev_ring_attention(const double *q, const double *k, const double *v, double *out, double *lse,
                                  const fadev_attention_params *params, const fadev_policy *policy,
                                  const fadev_ring_params *ring);
fadev_status fadev_ring_attention_backward(const double *q, const double *k, const double *v, const double *out,
                                           const double *lse, const double *dout, double *dq, double *dk,
                                           double *dv, const fadev_attention_params *params,
                                           const fadev_policy *policy, const fadev_policy_backward *policy_backward,
                                           const fadev_ring_params *ring);
/* The ring's merge of one piece into `rows` running rows, exactly as fadev_ring_attention merges (ring.c, top
 * comment): out (rows x dim), lse and seen (rows) are a rank's running state, updated in place; ob (rows x dim) and
 * lb (rows) the piece's out and lse. Reads ring->partial_lse, merge, running_out and running_lse. A row whose lb
 * rounds to -inf is left as it is; a row not yet seen takes the piece; a seen one is merged by the sigmoid /
 * log-sigmoid update. FADEV_ERR_INVALID_ARGUMENT for NULL arrays or dim < 1. */
fadev_status fadev_ring_merge(double *out, double *lse, unsigned char *seen, const double *ob, const double *lb,
                              int64_t rows, int64_t dim, const fadev_ring_params *ring);
/* count[i * seq + j] = how many ring pieces compute the pair (query i, key j) (seq x seq int32). */
fadev_status fadev_ring_coverage(int64_t seq, int causal, const fadev_ring_params *ring, int32_t *count);

/* ---------------------------------------------------------------- threads */

/* Worker threads used by every multi-threaded kernel (default: online CPUs, or FADEV_NUM_THREADS).
 * Results never depend on the thread count. */
int fadev_get_num_threads(void);
fadev_status fadev_set_num_threads(int n);

/* Run fn(ctx, task) for task in [0, n_tasks) on up to fadev_get_num_threads() threads. Tasks are
 * claimed in ascending order, so a task may wait for an earlier one (which is then running or done),
 * never for a later one (the backward's dQ pipeline relies on this). Memory a task writes is its own,
 * or handed over between tasks through such waits. Returns the first non-OK status. */
typedef fadev_status (*fadev_task_fn)(void *ctx, size_t task);
fadev_status fadev_parallel_for(size_t n_tasks, fadev_task_fn fn, void *ctx);

/* ---------------------------------------------------------------- CUDA (cuda/) */

/* 1 if the module was compiled with nvcc. */
int fadev_cuda_compiled(void);
/* number of usable CUDA devices (0 if none, no driver, or not compiled). Never fails. */
int fadev_cuda_device_count(void);
/* name, compute capability, memory of device `device`. */
fadev_status fadev_cuda_device_info(int device, char *name, size_t name_len, int *major, int *minor,
                                    size_t *total_memory);
/* Round n float64 values on the GPU (host pointers in and out): bit-identical to fadev_round_f64. */
fadev_status fadev_cuda_round_f64(const double *x, double *out, size_t n, const fadev_format *fmt,
                                  int mode, uint64_t seed, uint64_t stream, uint64_t index_offset);
/* the last CUDA error message seen by this thread (empty if none). */
const char *fadev_cuda_last_error(void);

/* Everything below takes DEVICE pointers (memory of the current CUDA device), runs on the legacy default
 * stream and synchronises before returning, so asynchronous faults are reported by the call that caused
 * them (FADEV_ERR_CUDA with CUDA's message in fadev_cuda_last_error; FADEV_ERR_NO_MEMORY, with it too, when the
 * device is out of memory: cudaErrorMemoryAllocation). FADEV_ERR_NO_CUDA: built without
 * nvcc, or no device. A CPU-only build takes stubs from cuda_stub.c. */

/* Device memory (memory.cu). kind: 0 host->device, 1 device->host, 2 device->device. */
fadev_status fadev_cuda_malloc(void **ptr, size_t bytes);
fadev_status fadev_cuda_free(void *ptr);
fadev_status fadev_cuda_memcpy(void *dst, const void *src, size_t bytes, int kind);
/* The device that owns a pointer (-1 for host memory), for interop checks. */
fadev_status fadev_cuda_pointer_device(const void *ptr, int *device);
/* The calling thread's current CUDA device: where fadev's allocations and kernels go (a framework that
 * selects a device, e.g. torch.cuda.set_device, sets it). */
fadev_status fadev_cuda_current_device(int *device);

/* Emulated-precision attention (emu_forward.cu, emu_backward.cu): the same contract, validation and errors
 * as the CPU entry points above, and the same result bit for bit (docs/numerics.md; NaN payloads aside). */
fadev_status fadev_cuda_baseline_attention(const double *q, const double *k, const double *v, double *out,
                                           double *lse, const fadev_attention_params *params,
                                           const fadev_policy *policy);
fadev_status fadev_cuda_flash_attention(const double *q, const double *k, const double *v, double *out, double *lse,
                                        const fadev_attention_params *params, const fadev_policy *policy);
fadev_status fadev_cuda_baseline_attention_backward(const double *q, const double *k, const double *v,
                                                    const double *out, const double *lse, const double *dout,
                                                    double *dq, double *dk, double *dv,
                                                    const fadev_attention_params *params, const fadev_policy *policy,
                                                    const fadev_policy_backward *policy_backward);
fadev_status fadev_cuda_flash_attention_backward(const double *q, const double *k, const double *v,
                                                 const double *out, const double *lse, const double *dout,
                                                 double *dq, double *dk, double *dv,
                                                 const fadev_attention_params *params, const fadev_policy *policy,
                                                 const fadev_policy_backward *policy_backward);

/* Golden attention on the GPU, fast (golden.cu): fp64 throughout on the fp64 tensor cores; the same
 * mathematics as the golden policy but not its operation order (within a few fp64 ulps of it). Forward
 * only; params' flash fields are ignored. lse may be NULL. */
fadev_status fadev_cuda_golden_attention(const double *q, const double *k, const double *v, double *out, double *lse,
                                         const fadev_attention_params *params);

/* Metrics on device arrays (metrics.cu). Deviation statistics: the same fields and NaN/inf rules as
 * fadev_deviation_stats (sums in another order: equal to it within rounding, not bit for bit).
 * Wasserstein-1: exact (device radix sort, then the same integral). ULP error: bit-identical. */
fadev_status fadev_cuda_deviation_stats(const double *test, const double *ref, size_t n, fadev_deviation *out);
fadev_status fadev_cuda_wasserstein(const double *a, size_t n_a, const double *b, size_t n_b, double *out);
fadev_status fadev_cuda_ulp_error(const double *test, const double *ref, size_t n, const fadev_format *fmt,
                                  double *out);
/* The emulated kernels' transcription of CUDA's fp64 exp (exp2_form 0) or exp2 (1) against CUDA's own (exp for
 * ref_form 0, exp2 for 1: the other form is the check's own test that it sees a difference), for the fp32 inputs whose
 * encodings are start .. start + count - 1 (at most 2^32): *mismatches = how many differ in any bit. */
fadev_status fadev_cuda_exp_check(int exp2_form, int ref_form, uint64_t start, uint64_t count, uint64_t *mismatches);
/* The emulated forward's table of softmax terms (cuda/emu_exp_table.cu) for bf16 (bf16 != 0) or fp16 and exp2_form,
 * against the computation (dbl_round of the transcribed exp in ref_form, as above) for every 16-bit encoding of a value
 * <= 0: *mismatches, and the table's clamp bounds in *lo, *hi (magnitude bits). */
fadev_status fadev_cuda_exp_table_check(int bf16, int exp2_form, int ref_form, uint64_t *mismatches, int *lo, int *hi);
/* The emulated baseline's P = R_p(e / l) from l's reciprocal (quot_round_rcp, cuda/emu_forward_fast.cuh) against the
 * division's (quot_round) for bf16 (bf16 != 0) or fp16 P, every e in [0, 1] and 53,248 values of l in [1, 2^13): *mismatches
 * of *pairs; naive != 0 checks the reciprocal's product rounded without the bounds' test instead (it must differ). */
fadev_status fadev_cuda_quot_check(int bf16, int naive, uint64_t *mismatches, uint64_t *pairs);
/* The emulated kernels' rounding of an fp32 value to bf16 (bf16 != 0) or fp16 (flt_round, cuda/emu.cuh: the hardware's
 * conversions) against the rule on the encoding, for all 2^32 fp32 inputs (NaN: any NaN): *mismatches; naive != 0
 * checks truncation instead (it must differ). */
fadev_status fadev_cuda_round_check(int bf16, int naive, uint64_t *mismatches);

/* Native FlashAttention-2-style kernel on the tensor cores (native_forward.cu, native_backward.cu): fp16 or bf16
 * inputs and outputs, fp32 accumulation (mma.sync), online softmax in fp32 with exp2. q, out, dout, dq:
 * (B, H, Nq, D); k, v, dk, dv: (B, Hkv, Nk, D), element type `dtype`, contiguous or with the strides `strides` gives
 * (rows of D contiguous elements: a model's (B, N, H, D) tensors read as (B, H, N, D) in place); lse (B, H, Nq) float32
 * (natural log). Supported: dim 64 or 128, the (block_q, block_kv) pairs fadev_cuda_native_tiles lists for the
 * direction (forward and backward have their own lists). FADEV_ERR_INVALID_ARGUMENT for anything else. The
 * backward recomputes P from lse and needs a float32 workspace of fadev_cuda_native_workspace() bytes (dq
 * accumulated in fp32 by atomic adds, or with `deterministic` by a separate pass over the K/V tiles without
 * atomics: the same bits on every run). */
typedef enum fadev_native_dtype { FADEV_NATIVE_FP16 = 0, FADEV_NATIVE_BF16 = 1 } fadev_native_dtype;
/* The tensors of fadev_native_params.strides, by index (the forward reads the first four). */
typedef enum fadev_native_tensor {
    FADEV_NATIVE_Q, FADEV_NATIVE_K, FADEV_NATIVE_V, FADEV_NATIVE_OUT, FADEV_NATIVE_DOUT, FADEV_NATIVE_DQ,
    FADEV_NATIVE_DK, FADEV_NATIVE_DV, FADEV_NATIVE_TENSORS
} fadev_native_tensor;
typedef struct fadev_native_params {
    fadev_attention_params attn; /* shapes, scale, causal (bottom-right aligned), block_q (Br), block_kv (Bc);
                                    loop_order, normalize and exp_form are not read */
    int32_t dtype;               /* fadev_native_dtype */
    int32_t deterministic;       /* backward only: 1 = dq without atomics (bit-reproducible), 0 = atomics */
    int32_t warp_rows;           /* tile rows per warp, 16 (0 means 16) or 32 (query rows forward, key rows backward);
                                    the same arithmetic, so the same bits, at another speed */
    int32_t mma;                 /* 0 = mma.sync (every GPU from sm_80), 1 = Hopper's wgmma (compute capability 9.0;
                                    its own tiles, warp_rows not read) */
    int32_t asynchronous;        /* 0: the kernels run on the legacy default stream and the call synchronises the
                                    device before it returns (as every entry point here); 1: every kernel of the call
                                    is queued on `stream` and the call returns without waiting, as a CUDA library call
                                    does (launch errors are returned; errors while the kernels run surface at the
                                    caller's next synchronisation) */
    void *stream;                /* with asynchronous: a cudaStream_t, e.g. PyTorch's current stream (NULL: the legacy
                                    default stream, PyTorch's default) */
    int32_t strided;             /* 0: every tensor contiguous; 1: `strides` gives their layouts */
    int64_t strides[FADEV_NATIVE_TENSORS][3]; /* with strided: element strides (batch, head, row) of each tensor
                                    (fadev_native_tensor), each a multiple of 8 (16 bytes) in [0, 2^48); every
                                    element of a row is contiguous. Outputs must not overlap each other or inputs */
} fadev_native_params;
/* Writes up to max_pairs (block_q, block_kv) pairs supported for head dim `dim` in one direction (backward 0: the
 * forward's, 1: the backward's) with `warp_rows` (16 or 32) tile rows per warp, or of the wgmma kernels (mma 1), into
 * tiles[2 * i], tiles[2 * i + 1]; *count receives how many there are (0 with FADEV_ERR_INVALID_ARGUMENT for a head
 * dim, or a direction, without any). */
fadev_status fadev_cuda_native_tiles(int dim, int backward, int warp_rows, int mma, int32_t *tiles, int max_pairs,
                                     int *count);
fadev_status fadev_cuda_native_forward(const void *q, const void *k, const void *v, void *out, float *lse,
                                       const fadev_native_params *params);
size_t fadev_cuda_native_workspace(const fadev_native_params *params);
fadev_status fadev_cuda_native_backward(const void *q, const void *k, const void *v, const void *out,
                                        const float *lse, const void *dout, void *dq, void *dk, void *dv,
                                        float *workspace, const fadev_native_params *params);

#ifdef __cplusplus
}
#endif

#endif /* FADEV_H */
