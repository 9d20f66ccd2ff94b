/* fadev._core's private methods for the CPU kernels' fast paths (csrc/fast.c, the FMA tier of csrc/matmul.c), used by
 * tests/test_fast_paths.py and benchmarks/bench_emulation.py: the switch that forces the generic paths, counters
 * of what ran, and the vector rounding and exp passes on an array. Not public API. */
#include "module.h"

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fadev_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

#include "attention.h"

/* CPython passes (self, args) to every method; most of ours use neither self nor, for METH_NOARGS, args. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

/* _set_fast_paths(on, avx512=True) -> the previous `on`: False makes the CPU kernels take their generic paths (no
 * FMA tier, no vector element-wise steps), which the fast ones must equal bit for bit; avx512=False keeps the fast
 * paths but runs their AVX2 kernels where the CPU has AVX-512. */
static PyObject *py_set_fast_paths(PyObject *self, PyObject *args) {
    int on, avx512 = 1;
    if (!PyArg_ParseTuple(args, "p|p", &on, &avx512)) return NULL;
    return PyBool_FromLong(att_set_fast(on, avx512));
}

/* _fast_path_counts() -> (calls that ran the vector element-wise steps, products that ran the FMA tier, 1 if this
 * CPU runs the FMA kernels). */
static PyObject *py_fast_path_counts(PyObject *self, PyObject *args) {
    unsigned long long calls, products;
    att_fast_counts(&calls, &products);
    return Py_BuildValue("KKi", calls, products, att_cpu_fma());
}

/* _fast_round(x, fmt, op) -> R_fmt(x) (op 0), R_fmt(exp2(x)) (1) or R_fmt(exp(x)) (2), nearest-even, by the
 * kernels' vector passes, which must equal fadev.round of x or of libm's values. */
static PyObject *py_fast_round(PyObject *self, PyObject *args) {
    PyObject *x;
    fadev_format fmt;
    int op;
    if (!PyArg_ParseTuple(args, "OO&i", &x, parse_format, &fmt, &op)) return NULL;
    if (op < 0 || op > 2) return PyErr_Format(PyExc_ValueError, "op must be 0, 1 or 2, got %d", op);
    fadev_policy pol;
    memset(&pol, 0, sizeof pol);
    pol.rounding = FADEV_ROUND_NEAREST_EVEN;
    const att_stage st = att_make_stage(&fmt, &pol);
    PyObject *in = as_array(x, NPY_FLOAT64, "x");
    if (!in) return NULL;
    PyObject *out = new_like(in, -1, NPY_FLOAT64);
    if (out) {
        const double *src = PyArray_DATA((PyArrayObject *)in);
        double *dst = PyArray_DATA((PyArrayObject *)out);
        const int64_t n = (int64_t)PyArray_SIZE((PyArrayObject *)in);
        Py_BEGIN_ALLOW_THREADS
        if (op == 0) att_round_n(&st, src, dst, n);
        else att_exp_round_n(&st, op == 1, src, dst, n);
        Py_END_ALLOW_THREADS
    }
    Py_DECREF(in);
    return out;
}

PyMethodDef fast_methods[] = {
    {"_set_fast_paths", py_set_fast_paths, METH_VARARGS, "_set_fast_paths(on, avx512=True) -> previous on"},
    {"_fast_path_counts", py_fast_path_counts, METH_NOARGS, "_fast_path_counts() -> (calls, FMA products, FMA CPU)"},
    {"_fast_round", py_fast_round, METH_VARARGS, "_fast_round(x, fmt, op) -> R_fmt(x, exp2(x), exp(x))"},
    {NULL, NULL, 0, NULL}};
