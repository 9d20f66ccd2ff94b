/* fadev._core's argument handling, shared by module.c and module_cuda.c: status -> exception, the
 * converters of formats, policies, ring parameters, device pointers and CUDA parameter tuples, array
 * conversion, and the option lists of the attention entry points. No arithmetic. */
#include "module.h"

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fadev_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

/* ------------------------------------------------------------ errors */

static PyObject *raise_with(fadev_status st, const char *what, int device) {
    PyObject *kind = PyExc_RuntimeError;
    switch (st) {
    case FADEV_ERR_INVALID_FORMAT:
    case FADEV_ERR_INVALID_MODE:
    case FADEV_ERR_INVALID_ARGUMENT:
    case FADEV_ERR_SHAPE:
    case FADEV_ERR_NOT_REPRESENTABLE: kind = PyExc_ValueError; break;
    case FADEV_ERR_OVERFLOW:
    case FADEV_ERR_NO_MEMORY: kind = PyExc_MemoryError; break;
    default: break;
    }
    if (st == FADEV_ERR_CUDA || st == FADEV_ERR_NO_CUDA || (device && st == FADEV_ERR_NO_MEMORY))
        PyErr_Format(kind, "%s: %s (%s)", what, fadev_status_string(st), fadev_cuda_last_error());
    else
        PyErr_Format(kind, "%s: %s", what, fadev_status_string(st));
    return NULL;
}

PyObject *raise_status(fadev_status st, const char *what) { return raise_with(st, what, 0); }

PyObject *raise_device_status(fadev_status st, const char *what) { return raise_with(st, what, 1); }

/* ------------------------------------------------------------ converters */

/* A format arrives as the tuple (precision, emin, emax, subnormals, has_inf, overflow, largest). */
int parse_format(PyObject *obj, void *out) {
    int p, emin, emax, sub, inf, overflow;
    double largest;
    if (!PyArg_ParseTuple(obj, "iiiiiid;fmt must be a (precision, emin, emax, subnormals, has_inf, "
                               "overflow, largest) tuple", &p, &emin, &emax, &sub, &inf, &overflow, &largest))
        return 0;
    fadev_status st = fadev_format_make(p, emin, emax, sub, inf, overflow, largest, (fadev_format *)out);
    if (st != FADEV_OK) {
        raise_status(st, "fmt");
        return 0;
    }
    return 1;
}

/* A policy arrives as Policy._c: 13 format tuples in fadev_policy field order, rounding, seed. */
int parse_policy(PyObject *obj, void *out) {
    fadev_policy *pol = (fadev_policy *)out;
    int rounding;
    unsigned long long seed;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 15) {
        PyErr_Format(PyExc_TypeError, "policy must be a tuple of 13 format tuples, rounding and seed (Policy._c), "
                                      "got %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    if (!PyArg_ParseTuple(obj, "O&O&O&O&O&O&O&O&O&O&O&O&O&iK;policy must be Policy._c", parse_format, &pol->input,
                          parse_format, &pol->score_acc, parse_format, &pol->score, parse_format, &pol->softmax,
                          parse_format, &pol->sum_acc, parse_format, &pol->stats, parse_format, &pol->rescale,
                          parse_format, &pol->p, parse_format, &pol->pv_acc, parse_format, &pol->out_acc,
                          parse_format, &pol->state_out, parse_format, &pol->state_stats, parse_format, &pol->out,
                          &rounding, &seed))
        return 0;
    pol->rounding = rounding;
    pol->seed = seed;
    return 1;
}

/* A backward policy arrives as Policy._c_backward: 11 format tuples in fadev_policy_backward field order, then the
 * ds_scaled flag. */
int parse_policy_backward(PyObject *obj, void *out) {
    fadev_policy_backward *pb = (fadev_policy_backward *)out;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 12) {
        PyErr_Format(PyExc_TypeError, "policy_backward must be a tuple of 11 format tuples and a flag "
                                      "(Policy._c_backward), got %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    int ds_scaled;
    if (!PyArg_ParseTuple(obj, "O&O&O&O&O&O&O&O&O&O&O&p;policy_backward must be Policy._c_backward", parse_format,
                          &pb->bwd_p, parse_format, &pb->dsoft_p, parse_format, &pb->dp_acc, parse_format, &pb->dp,
                          parse_format, &pb->delta_acc, parse_format, &pb->dsoft, parse_format, &pb->ds, parse_format,
                          &pb->grad_acc, parse_format, &pb->dq_acc, parse_format, &pb->dkv_acc, parse_format,
                          &pb->grad, &ds_scaled))
        return 0;
    pb->ds_scaled = ds_scaled;
    return 1;
}

/* Ring params arrive as RingMerge._c: (world_size, layout, allgather, 9 format tuples in field order). */
int parse_ring(PyObject *obj, void *out) {
    fadev_ring_params *rp = (fadev_ring_params *)out;
    int w, layout, allgather;
    if (!PyArg_ParseTuple(obj, "iiiO&O&O&O&O&O&O&O&O&;ring must be RingMerge._c(...)", &w, &layout, &allgather,
                          parse_format, &rp->partial_out, parse_format, &rp->partial_lse, parse_format, &rp->merge,
                          parse_format, &rp->running_out, parse_format, &rp->running_lse, parse_format,
                          &rp->partial_grad, parse_format, &rp->dq_acc, parse_format, &rp->dkv_acc, parse_format,
                          &rp->dkv_transport))
        return 0;
    rp->world_size = w, rp->layout = layout, rp->allgather = allgather;
    return 1;
}

/* A device address: a non-negative Python int (0 means NULL). */
int parse_ptr(PyObject *obj, void *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a device pointer must be an int, got %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(obj);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *(void **)out = (void *)(uintptr_t)address;
    return 1;
}

/* The shapes of a device call: (batch, heads, heads_kv, seq_q, seq_kv, dim) into a fadev_attention_params. */
int parse_shape(PyObject *obj, void *out) {
    fadev_attention_params *pr = (fadev_attention_params *)out;
    long long s[6];
    if (!PyArg_ParseTuple(obj, "LLLLLL;shape must be (batch, heads, heads_kv, seq_q, seq_kv, dim)", &s[0], &s[1],
                          &s[2], &s[3], &s[4], &s[5]))
        return 0;
    pr->batch = s[0], pr->heads = s[1], pr->heads_kv = s[2], pr->seq_q = s[3], pr->seq_kv = s[4], pr->dim = s[5];
    return 1;
}

/* The native kernels' own options (dtype, deterministic, warp_rows, mma[, stream[, strides]]) into a fadev_native_params (attn
 * untouched); a stream (a cudaStream_t as an int, PyTorch's current stream; 0 is the legacy default stream) makes the
 * call asynchronous on it; absent: the legacy stream and a device synchronisation. */
int parse_native(PyObject *obj, void *out) {
    fadev_native_params *np = (fadev_native_params *)out;
    int dtype, deterministic, warp_rows, mma;
    unsigned long long stream = 0;
    PyObject *strides = NULL;
    if (!PyArg_ParseTuple(obj, "ipii|KO;native options must be (dtype, deterministic, warp_rows, mma[, stream[, strides]])",
                          &dtype, &deterministic, &warp_rows, &mma, &stream, &strides))
        return 0;
    np->dtype = dtype, np->deterministic = deterministic, np->warp_rows = warp_rows, np->mma = mma;
    np->asynchronous = PyTuple_Check(obj) && PyTuple_GET_SIZE(obj) >= 5;
    np->stream = (void *)(uintptr_t)stream;
    np->strided = 0;
    if (strides && strides != Py_None) { /* (batch, head, row) element strides per tensor, fadev_native_tensor order */
        const Py_ssize_t n = PyTuple_Check(strides) ? PyTuple_GET_SIZE(strides) : -1;
        if (n != 12 && n != 3 * FADEV_NATIVE_TENSORS) {
            PyErr_SetString(PyExc_TypeError, "native options: strides must be a tuple of 12 (q, k, v, out) or 24 (and "
                                             "dout, dq, dk, dv) integers");
            return 0;
        }
        memset(np->strides, 0, sizeof np->strides);
        for (Py_ssize_t i = 0; i < n; i++) {
            const long long x = PyLong_AsLongLong(PyTuple_GET_ITEM(strides, i));
            if (x == -1 && PyErr_Occurred()) return 0;
            np->strides[i / 3][i % 3] = x;
        }
        np->strided = 1;
    }
    return 1;
}

/* ------------------------------------------------------------ arrays */

/* obj as an aligned C-contiguous array of type. A copy that cannot be allocated is a MemoryError naming the
 * argument and the bytes it needed (never a TypeError); anything else that fails is a TypeError. */
PyObject *as_array(PyObject *obj, int type, const char *name) {
    PyObject *arr = PyArray_FROMANY(obj, type, 0, 0, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (arr) return arr;
    if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
        PyErr_Clear();
        if (PyArray_Check(obj)) {
            PyArrayObject *a = (PyArrayObject *)obj;
            int itemsize = type == NPY_UINT8 ? 1 : type == NPY_UINT16 ? 2 : type == NPY_FLOAT32 || type == NPY_UINT32 ? 4 : 8;
            unsigned long long bytes = (unsigned long long)PyArray_MultiplyList(PyArray_DIMS(a), PyArray_NDIM(a));
            PyErr_Format(PyExc_MemoryError, "%s: cannot allocate %llu bytes for a contiguous copy", name,
                         bytes * (unsigned long long)itemsize);
        } else {
            PyErr_Format(PyExc_MemoryError, "%s: cannot allocate a contiguous copy", name);
        }
        return NULL;
    }
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "%s: expected a real numeric array, got %.100s", name, Py_TYPE(obj)->tp_name);
    return NULL;
}

PyObject *new_like(PyObject *shape_of, int ndim, int type) {
    PyArrayObject *a = (PyArrayObject *)shape_of;
    return PyArray_SimpleNew(ndim < 0 ? PyArray_NDIM(a) : ndim, PyArray_DIMS(a), type);
}

/* ------------------------------------------------------------ the call spec of the attention entry points */

/* item (None allowed unless required) through convert; 0 with an exception. */
static int optional(PyObject *item, int required, int (*convert)(PyObject *, void *), void *out, const char *name,
                    const char *what) {
    if (item != Py_None) return convert(item, out);
    if (!required) return 1;
    PyErr_Format(PyExc_TypeError, "%s: the call spec's %s is None, and this kernel reads it", what, name);
    return 0;
}

int parse_call(PyObject *obj, int needs, call_options *c, const char *what) {
    fadev_attention_params *pr = &c->pr;
    PyObject *policy, *policy_backward, *ring;
    int causal;
    memset(c, 0, sizeof *c);
    if (!PyTuple_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: the call spec must be a tuple (fadev._args.Call.c), got %.100s", what,
                     Py_TYPE(obj)->tp_name);
        return 0;
    }
    if (!PyArg_ParseTuple(obj, "OOOdpiiiii;the call spec must be (policy, policy_backward, ring, scale, causal, "
                               "block_q, block_kv, loop_order, normalize, exp_form) (fadev._args.Call.c)", &policy,
                          &policy_backward, &ring, &pr->scale, &causal, &pr->block_q, &pr->block_kv, &pr->loop_order,
                          &pr->normalize, &pr->exp_form))
        return 0;
    pr->causal = causal;
    return optional(policy, needs & NEEDS_POLICY, parse_policy, &c->policy, "policy", what) &&
           optional(policy_backward, needs & NEEDS_POLICY_BACKWARD, parse_policy_backward, &c->policy_backward,
                    "policy_backward", what) &&
           optional(ring, needs & NEEDS_RING, parse_ring, &c->ring, "ring", what);
}

PyObject *deviation_dict(const fadev_deviation *d) {
    return Py_BuildValue("{s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:K,s:K,s:K}", "max_abs", d->max_abs, "mean_diff",
                         d->mean_diff, "std_diff", d->std_diff, "mean_abs", d->mean_abs, "rmse", d->rmse,
                         "rel_l2", d->rel_l2, "max_rel", d->max_rel, "n", (unsigned long long)d->n, "n_nan",
                         (unsigned long long)d->n_nan, "n_inf", (unsigned long long)d->n_inf);
}
