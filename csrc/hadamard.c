/* Randomised Walsh-Hadamard rotation along the last axis ("incoherent processing", FlashAttention-3 §3.3).
 * For each row x (dim = D = 2^k values), with s a vector of +-1 signs (NULL: all +1):
 *   forward:  y = H_D (s * x) / sqrt(D)
 *   inverse:  x = s * (H_D y) / sqrt(D)
 * H_D is the Sylvester Hadamard matrix (H_1 = [1], H_2m = [[H_m, H_m], [H_m, -H_m]]; scipy.linalg.hadamard's
 * order), applied with the fast transform: k stages of butterflies (a, b) -> (a + b, a - b), D log2 D
 * additions in fp64, then one fp64 multiplication by 1/sqrt(D) (= 2^(-k/2), exact when k is even).
 * H_D H_D = D I, so the normalised rotation is orthogonal and its own inverse up to the signs: applying it
 * to both Q and K leaves every dot product Q_i . K_j unchanged in exact arithmetic while spreading an
 * outlier coordinate over all D coordinates. x: (rows, D) contiguous float64; out is x itself or disjoint.
 * Tasks are fixed blocks of rows (each row is transformed alone), so results do not depend on threads. */
#include <math.h>
#include <string.h>

#include "fadev.h"

enum { HADAMARD_TASK_ROWS = 64 };

typedef struct hadamard_job {
    const double *x;
    double *out;
    size_t rows, dim;
    const double *signs;
    int inverse;
    double norm;
} hadamard_job;

/* In-place unnormalised fast Walsh-Hadamard transform of one row of length dim (a power of two). */
static void fwht(double *y, size_t dim) {
    for (size_t h = 1; h < dim; h *= 2) {
        for (size_t i = 0; i < dim; i += 2 * h) {
            for (size_t j = i; j < i + h; j++) {
                double a = y[j], b = y[j + h];
                y[j] = a + b;
                y[j + h] = a - b;
            }
        }
    }
}

static fadev_status hadamard_task(void *ctxp, size_t task) {
    const hadamard_job *job = (const hadamard_job *)ctxp;
    const size_t D = job->dim;
    size_t first = task * HADAMARD_TASK_ROWS;
    size_t last = first + HADAMARD_TASK_ROWS < job->rows ? first + HADAMARD_TASK_ROWS : job->rows;
    for (size_t r = first; r < last; r++) {
        const double *x = job->x + r * D;
        double *y = job->out + r * D;
        if (y != x) memmove(y, x, D * sizeof(double));
        if (job->signs && !job->inverse)
            for (size_t t = 0; t < D; t++) y[t] *= job->signs[t];
        fwht(y, D);
        for (size_t t = 0; t < D; t++) y[t] *= job->norm;
        if (job->signs && job->inverse)
            for (size_t t = 0; t < D; t++) y[t] *= job->signs[t];
    }
    return FADEV_OK;
}

fadev_status fadev_hadamard_f64(const double *x, double *out, size_t rows, size_t dim, const double *signs,
                                int inverse) {
    if (!x || !out || rows == 0 || dim == 0 || (dim & (dim - 1)) != 0 || (inverse != 0 && inverse != 1))
        return FADEV_ERR_INVALID_ARGUMENT;
    if (rows > SIZE_MAX / dim) return FADEV_ERR_OVERFLOW;
    if (signs)
        for (size_t t = 0; t < dim; t++)
            if (signs[t] != 1.0 && signs[t] != -1.0) return FADEV_ERR_INVALID_ARGUMENT;
    hadamard_job job = {x, out, rows, dim, signs, inverse, 1.0 / sqrt((double)dim)};
    size_t tasks = (rows + HADAMARD_TASK_ROWS - 1) / HADAMARD_TASK_ROWS;
    return fadev_parallel_for(tasks, hadamard_task, &job);
}
