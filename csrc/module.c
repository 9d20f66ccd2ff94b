/* fadev._core: the one thin binding between Python and the C core.
 *
 * Each function here unpacks arguments, converts arrays to contiguous native float64 (or float32)
 * with NumPy, releases the GIL around the C call and turns a fadev_status into an exception that
 * names the parameter. No arithmetic happens here. Argument validation that needs more than a type
 * check is done by the Python layer (fadev/), which is what users call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include "fadev.h"
#include "module.h"

/* CPython passes (self, args) to every method; most of ours use neither self nor, for METH_NOARGS, args. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

/* ------------------------------------------------------------ helpers */

PyObject *raise_status(fadev_status st, const char *what) {
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
    /* cudaErrorMemoryAllocation: fadev_cuda_fail records CUDA's error name in the message */
    if (st == FADEV_ERR_CUDA && strstr(fadev_cuda_last_error(), "cudaErrorMemoryAllocation")) kind = PyExc_MemoryError;
    if (st == FADEV_ERR_CUDA || st == FADEV_ERR_NO_CUDA)
        PyErr_Format(kind, "%s: %s (%s)", what, fadev_status_string(st), fadev_cuda_last_error());
    else
        PyErr_Format(kind, "%s: %s", what, fadev_status_string(st));
    return NULL;
}

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

/* New reference to a C-contiguous, aligned, native-order array of `type` (copying if needed). */
static PyArrayObject *as_array(PyObject *obj, int type, const char *name) {
    PyArrayObject *arr = (PyArrayObject *)PyArray_FROMANY(obj, type, 0, 0, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!arr) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s: expected a real numeric array, got %.100s", name, Py_TYPE(obj)->tp_name);
    }
    return arr;
}

static PyArrayObject *new_like(PyArrayObject *shape_of, int type) {
    return (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(shape_of), PyArray_DIMS(shape_of), type);
}

/* ------------------------------------------------------------ formats */

static PyObject *py_round(PyObject *self, PyObject *args) {
    PyObject *xobj;
    fadev_format fmt;
    int mode;
    unsigned long long seed, stream, offset;
    if (!PyArg_ParseTuple(args, "OO&iKKK", &xobj, parse_format, &fmt, &mode, &seed, &stream, &offset)) return NULL;
    int is_f32 = PyArray_Check(xobj) && PyArray_TYPE((PyArrayObject *)xobj) == NPY_FLOAT32;
    PyArrayObject *x = as_array(xobj, is_f32 ? NPY_FLOAT32 : NPY_FLOAT64, "x");
    if (!x) return NULL;
    PyArrayObject *out = new_like(x, NPY_FLOAT64);
    if (!out) {
        Py_DECREF(x);
        return NULL;
    }
    fadev_status st;
    size_t n = (size_t)PyArray_SIZE(x);
    Py_BEGIN_ALLOW_THREADS
    if (is_f32)
        st = fadev_round_f32((const float *)PyArray_DATA(x), (double *)PyArray_DATA(out), n, &fmt, mode, seed, stream, offset);
    else
        st = fadev_round_f64((const double *)PyArray_DATA(x), (double *)PyArray_DATA(out), n, &fmt, mode, seed, stream, offset);
    Py_END_ALLOW_THREADS
    Py_DECREF(x);
    if (st != FADEV_OK) {
        Py_DECREF(out);
        return raise_status(st, "round");
    }
    return (PyObject *)out;
}

static int width_type(int width) {
    return width == 1 ? NPY_UINT8 : width == 2 ? NPY_UINT16 : width == 4 ? NPY_UINT32 : NPY_UINT64;
}

static PyObject *py_to_bits(PyObject *self, PyObject *args) {
    PyObject *xobj;
    fadev_format fmt;
    int width;
    if (!PyArg_ParseTuple(args, "OO&i", &xobj, parse_format, &fmt, &width)) return NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8)
        return PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8 bytes, got %d", width);
    PyArrayObject *x = as_array(xobj, NPY_FLOAT64, "x");
    if (!x) return NULL;
    PyArrayObject *out = new_like(x, width_type(width));
    if (!out) {
        Py_DECREF(x);
        return NULL;
    }
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_to_bits((const double *)PyArray_DATA(x), PyArray_DATA(out), width, (size_t)PyArray_SIZE(x), &fmt);
    Py_END_ALLOW_THREADS
    Py_DECREF(x);
    if (st != FADEV_OK) {
        Py_DECREF(out);
        return raise_status(st, "to_bits");
    }
    return (PyObject *)out;
}

static PyObject *py_from_bits(PyObject *self, PyObject *args) {
    PyObject *bobj;
    fadev_format fmt;
    if (!PyArg_ParseTuple(args, "OO&", &bobj, parse_format, &fmt)) return NULL;
    if (!PyArray_Check(bobj) || !PyArray_ISUNSIGNED((PyArrayObject *)bobj))
        return PyErr_Format(PyExc_TypeError, "bits must be an unsigned integer array (uint8/16/32/64)");
    int width = (int)PyArray_ITEMSIZE((PyArrayObject *)bobj);
    PyArrayObject *b = as_array(bobj, width_type(width), "bits");
    if (!b) return NULL;
    PyArrayObject *out = new_like(b, NPY_FLOAT64);
    if (!out) {
        Py_DECREF(b);
        return NULL;
    }
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_from_bits(PyArray_DATA(b), width, (double *)PyArray_DATA(out), (size_t)PyArray_SIZE(b), &fmt);
    Py_END_ALLOW_THREADS
    Py_DECREF(b);
    if (st != FADEV_OK) {
        Py_DECREF(out);
        return raise_status(st, "from_bits");
    }
    return (PyObject *)out;
}

static PyObject *py_format_layout(PyObject *self, PyObject *args) {
    fadev_format fmt;
    int k, total;
    if (!PyArg_ParseTuple(args, "O&", parse_format, &fmt)) return NULL;
    fadev_format_layout(&fmt, &k, &total);
    return Py_BuildValue("ii", k, total);
}

static PyObject *py_count_representable(PyObject *self, PyObject *args) {
    PyObject *xobj;
    fadev_format fmt;
    if (!PyArg_ParseTuple(args, "OO&", &xobj, parse_format, &fmt)) return NULL;
    PyArrayObject *x = as_array(xobj, NPY_FLOAT64, "x");
    if (!x) return NULL;
    size_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    fadev_count_representable((const double *)PyArray_DATA(x), (size_t)PyArray_SIZE(x), &fmt, &count);
    Py_END_ALLOW_THREADS
    Py_DECREF(x);
    return PyLong_FromSize_t(count);
}

/* ------------------------------------------------------------ threads and CUDA */

static PyObject *py_get_num_threads(PyObject *self, PyObject *args) {
    return PyLong_FromLong(fadev_get_num_threads());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    if (fadev_set_num_threads(n) != FADEV_OK)
        return PyErr_Format(PyExc_ValueError, "n must be between 1 and 256, got %d", n);
    Py_RETURN_NONE;
}

static PyObject *py_cuda_info(PyObject *self, PyObject *args) {
    int compiled = fadev_cuda_compiled();
    int count = fadev_cuda_device_count();
    PyObject *devices = PyList_New(0);
    if (!devices) return NULL;
    for (int d = 0; d < count; d++) {
        char name[256];
        int major = 0, minor = 0;
        size_t mem = 0;
        if (fadev_cuda_device_info(d, name, sizeof name, &major, &minor, &mem) != FADEV_OK) continue;
        PyObject *item = Py_BuildValue("{s:i,s:s,s:(ii),s:n}", "index", d, "name", name, "capability", major, minor,
                                       "total_memory", (Py_ssize_t)mem);
        if (!item || PyList_Append(devices, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(devices);
            return NULL;
        }
        Py_DECREF(item);
    }
    return Py_BuildValue("{s:O,s:N}", "compiled", compiled ? Py_True : Py_False, "devices", devices);
}

static PyObject *py_cuda_round(PyObject *self, PyObject *args) {
    PyObject *xobj;
    fadev_format fmt;
    int mode;
    unsigned long long seed, stream, offset;
    if (!PyArg_ParseTuple(args, "OO&iKKK", &xobj, parse_format, &fmt, &mode, &seed, &stream, &offset)) return NULL;
    PyArrayObject *x = as_array(xobj, NPY_FLOAT64, "x");
    if (!x) return NULL;
    PyArrayObject *out = new_like(x, NPY_FLOAT64);
    if (!out) {
        Py_DECREF(x);
        return NULL;
    }
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_round_f64((const double *)PyArray_DATA(x), (double *)PyArray_DATA(out), (size_t)PyArray_SIZE(x),
                              &fmt, mode, seed, stream, offset);
    Py_END_ALLOW_THREADS
    Py_DECREF(x);
    if (st != FADEV_OK) {
        Py_DECREF(out);
        return raise_status(st, "cuda round");
    }
    return (PyObject *)out;
}

/* ------------------------------------------------------------ metrics */

/* test and ref as contiguous float64 arrays of one size (the Python layer has checked the shapes). */
static int metric_pair(PyObject *tobj, PyObject *robj, const char *tname, const char *rname, int same_size,
                       PyArrayObject **t, PyArrayObject **r) {
    *t = as_array(tobj, NPY_FLOAT64, tname);
    if (!*t) return 0;
    *r = as_array(robj, NPY_FLOAT64, rname);
    if (!*r) {
        Py_DECREF(*t);
        return 0;
    }
    if (same_size && PyArray_SIZE(*t) != PyArray_SIZE(*r)) {
        PyErr_Format(PyExc_ValueError, "%s and %s must have the same size, got %zd and %zd", tname, rname,
                     (Py_ssize_t)PyArray_SIZE(*t), (Py_ssize_t)PyArray_SIZE(*r));
    } else if (PyArray_SIZE(*t) == 0 || PyArray_SIZE(*r) == 0) {
        PyErr_Format(PyExc_ValueError, "%s: empty array", PyArray_SIZE(*t) == 0 ? tname : rname);
    } else {
        return 1;
    }
    Py_DECREF(*t);
    Py_DECREF(*r);
    return 0;
}

static PyObject *py_deviation(PyObject *self, PyObject *args) {
    PyObject *tobj, *robj;
    if (!PyArg_ParseTuple(args, "OO", &tobj, &robj)) return NULL;
    PyArrayObject *t, *r;
    if (!metric_pair(tobj, robj, "test", "ref", 1, &t, &r)) return NULL;
    fadev_deviation dev;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_deviation_stats((const double *)PyArray_DATA(t), (const double *)PyArray_DATA(r),
                               (size_t)PyArray_SIZE(t), &dev);
    Py_END_ALLOW_THREADS
    Py_DECREF(t);
    Py_DECREF(r);
    if (st != FADEV_OK) return raise_status(st, "deviation");
    return deviation_dict(&dev);
}

PyObject *deviation_dict(const fadev_deviation *d) {
    return Py_BuildValue("{s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:K,s:K,s:K}", "max_abs", d->max_abs, "mean_diff",
                         d->mean_diff, "std_diff", d->std_diff, "mean_abs", d->mean_abs, "rmse", d->rmse,
                         "rel_l2", d->rel_l2, "max_rel", d->max_rel, "n", (unsigned long long)d->n, "n_nan",
                         (unsigned long long)d->n_nan, "n_inf", (unsigned long long)d->n_inf);
}

static PyObject *py_wasserstein(PyObject *self, PyObject *args) {
    PyObject *aobj, *bobj;
    int method;
    if (!PyArg_ParseTuple(args, "OOi", &aobj, &bobj, &method)) return NULL;
    PyArrayObject *a, *b;
    if (!metric_pair(aobj, bobj, "a", "b", 0, &a, &b)) return NULL;
    double w = 0;
    int used = 0;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_wasserstein((const double *)PyArray_DATA(a), (size_t)PyArray_SIZE(a), (const double *)PyArray_DATA(b),
                           (size_t)PyArray_SIZE(b), method, &w, &used);
    Py_END_ALLOW_THREADS
    Py_DECREF(a);
    Py_DECREF(b);
    if (st == FADEV_ERR_NOT_REPRESENTABLE)
        return PyErr_Format(PyExc_ValueError, "method='count' needs every value of a and b to be a finite "
                                              "bf16 number, or every value a finite fp16 number");
    if (st != FADEV_OK) return raise_status(st, "wasserstein");
    return Py_BuildValue("(di)", w, used);
}

static PyObject *py_sort(PyObject *self, PyObject *args) {
    PyObject *xobj;
    if (!PyArg_ParseTuple(args, "O", &xobj)) return NULL;
    PyArrayObject *x = as_array(xobj, NPY_FLOAT64, "x");
    if (!x) return NULL;
    npy_intp n = PyArray_SIZE(x);
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, &n, NPY_FLOAT64);
    if (!out) {
        Py_DECREF(x);
        return NULL;
    }
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_sort_f64((const double *)PyArray_DATA(x), (double *)PyArray_DATA(out), (size_t)n);
    Py_END_ALLOW_THREADS
    Py_DECREF(x);
    if (st != FADEV_OK) {
        Py_DECREF(out);
        return raise_status(st, "sort");
    }
    return (PyObject *)out;
}

static PyObject *py_ulp_error(PyObject *self, PyObject *args) {
    PyObject *tobj, *robj;
    fadev_format fmt;
    if (!PyArg_ParseTuple(args, "OOO&", &tobj, &robj, parse_format, &fmt)) return NULL;
    PyArrayObject *t, *r;
    if (!metric_pair(tobj, robj, "test", "ref", 1, &t, &r)) return NULL;
    PyArrayObject *out = new_like(t, NPY_FLOAT64);
    fadev_status st = FADEV_OK;
    if (out) {
        Py_BEGIN_ALLOW_THREADS
        st = fadev_ulp_error((const double *)PyArray_DATA(t), (const double *)PyArray_DATA(r), (size_t)PyArray_SIZE(t),
                             &fmt, (double *)PyArray_DATA(out));
        Py_END_ALLOW_THREADS
    }
    Py_DECREF(t);
    Py_DECREF(r);
    if (out && st != FADEV_OK) {
        Py_CLEAR(out);
        return raise_status(st, "ulp_error");
    }
    return (PyObject *)out;
}

static PyObject *py_ulp_histogram(PyObject *self, PyObject *args) {
    PyObject *tobj, *robj;
    fadev_format fmt;
    Py_ssize_t max_ulp;
    if (!PyArg_ParseTuple(args, "OOO&n", &tobj, &robj, parse_format, &fmt, &max_ulp)) return NULL;
    if (max_ulp < 1 || max_ulp > (1 << 20))
        return PyErr_Format(PyExc_ValueError, "max_ulp must be in 1..2^20, got %zd", max_ulp);
    PyArrayObject *t, *r;
    if (!metric_pair(tobj, robj, "test", "ref", 1, &t, &r)) return NULL;
    npy_intp len = (npy_intp)max_ulp + 1;
    PyArrayObject *counts = (PyArrayObject *)PyArray_SimpleNew(1, &len, NPY_UINT64);
    uint64_t n_nan = 0;
    fadev_status st = FADEV_OK;
    if (counts) {
        Py_BEGIN_ALLOW_THREADS
        st = fadev_ulp_histogram((const double *)PyArray_DATA(t), (const double *)PyArray_DATA(r),
                                 (size_t)PyArray_SIZE(t), &fmt, (size_t)max_ulp, (uint64_t *)PyArray_DATA(counts),
                                 &n_nan);
        Py_END_ALLOW_THREADS
    }
    Py_DECREF(t);
    Py_DECREF(r);
    if (!counts) return NULL;
    if (st != FADEV_OK) {
        Py_DECREF(counts);
        return raise_status(st, "ulp_histogram");
    }
    return Py_BuildValue("(NK)", counts, (unsigned long long)n_nan);
}

/* ------------------------------------------------------------ attention */

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

/* Shared by both kernels: q, k, v as 4-D float64 arrays -> params shapes, out and lse arrays, the call. */
static PyObject *attention_call(PyObject *qobj, PyObject *kobj, PyObject *vobj, fadev_attention_params *pr,
                                const fadev_policy *pol, int flash) {
    const char *what = flash ? "flash_attention" : "baseline_attention";
    PyArrayObject *q = as_array(qobj, NPY_FLOAT64, "q"), *k = NULL, *v = NULL, *out = NULL, *lse = NULL;
    if (!q || !(k = as_array(kobj, NPY_FLOAT64, "k")) || !(v = as_array(vobj, NPY_FLOAT64, "v"))) goto fail;
    if (PyArray_NDIM(q) != 4 || PyArray_NDIM(k) != 4 || PyArray_NDIM(v) != 4) {
        PyErr_Format(PyExc_ValueError, "%s: q, k, v must be 4-D (batch, heads, seq, dim), got %d-D, %d-D, %d-D", what,
                     PyArray_NDIM(q), PyArray_NDIM(k), PyArray_NDIM(v));
        goto fail;
    }
    npy_intp *qs = PyArray_DIMS(q), *ks = PyArray_DIMS(k), *vs = PyArray_DIMS(v);
    if (ks[0] != vs[0] || ks[1] != vs[1] || ks[2] != vs[2] || ks[3] != vs[3] || ks[0] != qs[0] || ks[3] != qs[3]) {
        PyErr_Format(PyExc_ValueError, "%s: shapes do not agree: q (%zd, %zd, %zd, %zd), k (%zd, %zd, %zd, %zd), "
                     "v (%zd, %zd, %zd, %zd)", what, qs[0], qs[1], qs[2], qs[3], ks[0], ks[1], ks[2], ks[3], vs[0],
                     vs[1], vs[2], vs[3]);
        goto fail;
    }
    pr->batch = qs[0], pr->heads = qs[1], pr->seq_q = qs[2], pr->dim = qs[3];
    pr->heads_kv = ks[1], pr->seq_kv = ks[2];
    npy_intp lse_dims[3] = {qs[0], qs[1], qs[2]};
    out = (PyArrayObject *)PyArray_SimpleNew(4, qs, NPY_FLOAT64);
    lse = (PyArrayObject *)PyArray_SimpleNew(3, lse_dims, NPY_FLOAT64);
    if (!out || !lse) goto fail;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    if (flash)
        st = fadev_flash_attention((const double *)PyArray_DATA(q), (const double *)PyArray_DATA(k),
                                   (const double *)PyArray_DATA(v), (double *)PyArray_DATA(out),
                                   (double *)PyArray_DATA(lse), pr, pol);
    else
        st = fadev_baseline_attention((const double *)PyArray_DATA(q), (const double *)PyArray_DATA(k),
                                      (const double *)PyArray_DATA(v), (double *)PyArray_DATA(out),
                                      (double *)PyArray_DATA(lse), pr, pol);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) {
        raise_status(st, what);
        goto fail;
    }
    Py_DECREF(q), Py_DECREF(k), Py_DECREF(v);
    return Py_BuildValue("(NN)", out, lse);
fail:
    Py_XDECREF(q), Py_XDECREF(k), Py_XDECREF(v), Py_XDECREF(out), Py_XDECREF(lse);
    return NULL;
}

static PyObject *py_baseline_attention(PyObject *self, PyObject *args) {
    PyObject *q, *k, *v;
    fadev_policy pol;
    fadev_attention_params pr;
    memset(&pr, 0, sizeof pr);
    int causal;
    if (!PyArg_ParseTuple(args, "OOOO&dp", &q, &k, &v, parse_policy, &pol, &pr.scale, &causal)) return NULL;
    pr.causal = causal;
    return attention_call(q, k, v, &pr, &pol, 0);
}

static PyObject *py_flash_attention(PyObject *self, PyObject *args) {
    PyObject *q, *k, *v;
    fadev_policy pol;
    fadev_attention_params pr;
    memset(&pr, 0, sizeof pr);
    int causal, block_q, block_kv, loop_order, normalize, exp_form;
    if (!PyArg_ParseTuple(args, "OOOO&dpiiiii", &q, &k, &v, parse_policy, &pol, &pr.scale, &causal, &block_q,
                          &block_kv, &loop_order, &normalize, &exp_form))
        return NULL;
    pr.causal = causal, pr.block_q = block_q, pr.block_kv = block_kv;
    pr.loop_order = loop_order, pr.normalize = normalize, pr.exp_form = exp_form;
    return attention_call(q, k, v, &pr, &pol, 1);
}


/* ------------------------------------------------------------ backward */

/* A backward policy arrives as Policy._c_backward: 10 format tuples in fadev_policy_backward field order. */
int parse_policy_backward(PyObject *obj, void *out) {
    fadev_policy_backward *pb = (fadev_policy_backward *)out;
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 10) {
        PyErr_Format(PyExc_TypeError, "policy_backward must be a tuple of 10 format tuples (Policy._c_backward), "
                                      "got %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    return PyArg_ParseTuple(obj, "O&O&O&O&O&O&O&O&O&O&;policy_backward must be Policy._c_backward", parse_format,
                            &pb->bwd_p, parse_format, &pb->dp_acc, parse_format, &pb->dp, parse_format,
                            &pb->delta_acc, parse_format, &pb->dsoft, parse_format, &pb->ds, parse_format,
                            &pb->grad_acc, parse_format, &pb->dq_acc, parse_format, &pb->dkv_acc, parse_format,
                            &pb->grad);
}

/* Shared by every backward (baseline, flash, ring): q, k, v, out, lse, dout as float64 arrays (4-D; out and
 * dout shaped like q, lse like q without D) -> params shapes, dq, dk, dv arrays, the call. `ring` is NULL
 * except for the ring simulation. */
enum backward_kind { BACKWARD_BASELINE, BACKWARD_FLASH, BACKWARD_RING };

static PyObject *backward_call(PyObject *const objs[6], fadev_attention_params *pr, const fadev_policy *pol,
                               const fadev_policy_backward *pb, int kind, const fadev_ring_params *ring) {
    static const char *const whats[3] = {"baseline_attention_backward", "flash_attention_backward",
                                         "ring_attention_backward"};
    const char *what = whats[kind];
    static const char *names[6] = {"q", "k", "v", "out", "lse", "dout"};
    PyArrayObject *a[6] = {NULL, NULL, NULL, NULL, NULL, NULL}, *dq = NULL, *dk = NULL, *dv = NULL;
    for (int x = 0; x < 6; x++)
        if (!(a[x] = as_array(objs[x], NPY_FLOAT64, names[x]))) goto fail;
    for (int x = 0; x < 6; x++)
        if (PyArray_NDIM(a[x]) != (x == 4 ? 3 : 4)) {
            PyErr_Format(PyExc_ValueError, "%s: %s must be %d-D, got %d-D", what, names[x], x == 4 ? 3 : 4,
                         PyArray_NDIM(a[x]));
            goto fail;
        }
    npy_intp *qs = PyArray_DIMS(a[0]), *ks = PyArray_DIMS(a[1]), *vs = PyArray_DIMS(a[2]), *ls = PyArray_DIMS(a[4]);
    int agree = ks[0] == qs[0] && ks[3] == qs[3] && ls[0] == qs[0] && ls[1] == qs[1] && ls[2] == qs[2];
    for (int d = 0; d < 4; d++)
        agree = agree && vs[d] == ks[d] && PyArray_DIMS(a[3])[d] == qs[d] && PyArray_DIMS(a[5])[d] == qs[d];
    if (!agree) {
        PyErr_Format(PyExc_ValueError, "%s: shapes do not agree: q (%zd, %zd, %zd, %zd), k (%zd, %zd, %zd, %zd), "
                     "v (%zd, %zd, %zd, %zd), lse (%zd, %zd, %zd); out and dout must be shaped like q", what, qs[0],
                     qs[1], qs[2], qs[3], ks[0], ks[1], ks[2], ks[3], vs[0], vs[1], vs[2], vs[3], ls[0], ls[1], ls[2]);
        goto fail;
    }
    pr->batch = qs[0], pr->heads = qs[1], pr->seq_q = qs[2], pr->dim = qs[3];
    pr->heads_kv = ks[1], pr->seq_kv = ks[2];
    dq = new_like(a[0], NPY_FLOAT64), dk = new_like(a[1], NPY_FLOAT64), dv = new_like(a[2], NPY_FLOAT64);
    if (!dq || !dk || !dv) goto fail;
    const double *in[6];
    for (int x = 0; x < 6; x++) in[x] = (const double *)PyArray_DATA(a[x]);
    double *gq = (double *)PyArray_DATA(dq), *gk = (double *)PyArray_DATA(dk), *gv = (double *)PyArray_DATA(dv);
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    if (kind == BACKWARD_FLASH)
        st = fadev_flash_attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], gq, gk, gv, pr, pol, pb);
    else if (kind == BACKWARD_RING)
        st = fadev_ring_attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], gq, gk, gv, pr, pol, pb, ring);
    else
        st = fadev_baseline_attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], gq, gk, gv, pr, pol, pb);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) {
        raise_status(st, what);
        goto fail;
    }
    for (int x = 0; x < 6; x++) Py_DECREF(a[x]);
    return Py_BuildValue("(NNN)", dq, dk, dv);
fail:
    for (int x = 0; x < 6; x++) Py_XDECREF(a[x]);
    Py_XDECREF(dq), Py_XDECREF(dk), Py_XDECREF(dv);
    return NULL;
}

static PyObject *py_baseline_attention_backward(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    fadev_policy pol;
    fadev_policy_backward pb;
    fadev_attention_params pr;
    memset(&pr, 0, sizeof pr);
    int causal;
    if (!PyArg_ParseTuple(args, "OOOOOOO&O&dp", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          parse_policy, &pol, parse_policy_backward, &pb, &pr.scale, &causal))
        return NULL;
    pr.causal = causal;
    return backward_call(objs, &pr, &pol, &pb, BACKWARD_BASELINE, NULL);
}

static PyObject *py_flash_attention_backward(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    fadev_policy pol;
    fadev_policy_backward pb;
    fadev_attention_params pr;
    memset(&pr, 0, sizeof pr);
    int causal, block_q, block_kv, exp_form;
    if (!PyArg_ParseTuple(args, "OOOOOOO&O&dpiii", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          parse_policy, &pol, parse_policy_backward, &pb, &pr.scale, &causal, &block_q, &block_kv,
                          &exp_form))
        return NULL;
    pr.causal = causal, pr.block_q = block_q, pr.block_kv = block_kv, pr.exp_form = exp_form;
    return backward_call(objs, &pr, &pol, &pb, BACKWARD_FLASH, NULL);
}

/* ------------------------------------------------------------ hadamard */

/* hadamard(x, signs or None, inverse): x (..., D) float64 -> rotated copy of the same shape. */
static PyObject *py_hadamard(PyObject *self, PyObject *args) {
    PyObject *xobj, *sobj;
    int inverse;
    if (!PyArg_ParseTuple(args, "OOp", &xobj, &sobj, &inverse)) return NULL;
    PyArrayObject *x = as_array(xobj, NPY_FLOAT64, "x"), *s = NULL, *out = NULL;
    if (!x) return NULL;
    if (PyArray_NDIM(x) < 1 || PyArray_SIZE(x) == 0) {
        PyErr_Format(PyExc_ValueError, "x: expected a non-empty array of at least 1 dimension");
        goto fail;
    }
    size_t dim = (size_t)PyArray_DIM(x, PyArray_NDIM(x) - 1), rows = (size_t)PyArray_SIZE(x) / dim;
    if (sobj != Py_None) {
        if (!(s = as_array(sobj, NPY_FLOAT64, "signs"))) goto fail;
        if (PyArray_NDIM(s) != 1 || (size_t)PyArray_DIM(s, 0) != dim) {
            PyErr_Format(PyExc_ValueError, "signs: expected shape (%zu,), got %zd elements in %d dimension(s)", dim,
                         (Py_ssize_t)PyArray_SIZE(s), PyArray_NDIM(s));
            goto fail;
        }
    }
    if (!(out = new_like(x, NPY_FLOAT64))) goto fail;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_hadamard_f64((const double *)PyArray_DATA(x), (double *)PyArray_DATA(out), rows, dim,
                            s ? (const double *)PyArray_DATA(s) : NULL, inverse);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) {
        raise_status(st, "hadamard (dim must be a power of two, signs +-1)");
        goto fail;
    }
    Py_DECREF(x);
    Py_XDECREF(s);
    return (PyObject *)out;
fail:
    Py_XDECREF(x), Py_XDECREF(s), Py_XDECREF(out);
    return NULL;
}

/* ------------------------------------------------------------ ring */

/* Ring params arrive as RingMerge._c: (world_size, layout, allgather, 9 format tuples in field order). */
static int parse_ring(PyObject *obj, void *out) {
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

/* n arrays as contiguous float64 with the given ranks; the Python layer (fadev/ring.py) checked shapes. */
static int ring_arrays(PyObject *const *objs, PyArrayObject **a, const char *const *names, const int *ranks, int n) {
    for (int x = 0; x < n; x++) {
        if (!(a[x] = as_array(objs[x], NPY_FLOAT64, names[x]))) return 0;
        if (PyArray_NDIM(a[x]) != ranks[x]) {
            PyErr_Format(PyExc_ValueError, "ring_attention: %s must be %d-D, got %d-D", names[x], ranks[x],
                         PyArray_NDIM(a[x]));
            return 0;
        }
    }
    return 1;
}

static void ring_shapes(PyArrayObject *q, PyArrayObject *k, fadev_attention_params *pr) {
    pr->batch = PyArray_DIMS(q)[0], pr->heads = PyArray_DIMS(q)[1], pr->seq_q = PyArray_DIMS(q)[2];
    pr->dim = PyArray_DIMS(q)[3], pr->heads_kv = PyArray_DIMS(k)[1], pr->seq_kv = PyArray_DIMS(k)[2];
}

static PyObject *py_ring_attention(PyObject *self, PyObject *args) {
    static const char *const names[3] = {"q", "k", "v"};
    static const int ranks[3] = {4, 4, 4};
    PyObject *objs[3];
    PyArrayObject *a[3] = {NULL, NULL, NULL}, *out = NULL, *lse = NULL;
    fadev_policy pol;
    fadev_ring_params rp;
    fadev_attention_params pr;
    memset(&pr, 0, sizeof pr);
    int causal, block_q, block_kv, loop_order, normalize, exp_form;
    if (!PyArg_ParseTuple(args, "OOOO&O&dpiiiii", &objs[0], &objs[1], &objs[2], parse_policy, &pol, parse_ring, &rp,
                          &pr.scale, &causal, &block_q, &block_kv, &loop_order, &normalize, &exp_form))
        return NULL;
    pr.causal = causal, pr.block_q = block_q, pr.block_kv = block_kv;
    pr.loop_order = loop_order, pr.normalize = normalize, pr.exp_form = exp_form;
    if (!ring_arrays(objs, a, names, ranks, 3)) goto fail;
    ring_shapes(a[0], a[1], &pr);
    out = new_like(a[0], NPY_FLOAT64);
    lse = (PyArrayObject *)PyArray_SimpleNew(3, PyArray_DIMS(a[0]), NPY_FLOAT64);
    if (!out || !lse) goto fail;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_ring_attention((const double *)PyArray_DATA(a[0]), (const double *)PyArray_DATA(a[1]),
                              (const double *)PyArray_DATA(a[2]), (double *)PyArray_DATA(out),
                              (double *)PyArray_DATA(lse), &pr, &pol, &rp);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) {
        raise_status(st, "ring_attention");
        goto fail;
    }
    Py_DECREF(a[0]), Py_DECREF(a[1]), Py_DECREF(a[2]);
    return Py_BuildValue("(NN)", out, lse);
fail:
    Py_XDECREF(a[0]), Py_XDECREF(a[1]), Py_XDECREF(a[2]), Py_XDECREF(out), Py_XDECREF(lse);
    return NULL;
}

static PyObject *py_ring_attention_backward(PyObject *self, PyObject *args) {
    PyObject *objs[6];
    fadev_policy pol;
    fadev_policy_backward pb;
    fadev_ring_params rp;
    fadev_attention_params pr;
    memset(&pr, 0, sizeof pr);
    int causal, block_q, block_kv, exp_form;
    if (!PyArg_ParseTuple(args, "OOOOOOO&O&O&dpiii", &objs[0], &objs[1], &objs[2], &objs[3], &objs[4], &objs[5],
                          parse_policy, &pol, parse_policy_backward, &pb, parse_ring, &rp, &pr.scale, &causal,
                          &block_q, &block_kv, &exp_form))
        return NULL;
    pr.causal = causal, pr.block_q = block_q, pr.block_kv = block_kv, pr.exp_form = exp_form;
    return backward_call(objs, &pr, &pol, &pb, BACKWARD_RING, &rp);
}

static PyObject *py_ring_coverage(PyObject *self, PyObject *args) {
    long long seq;
    int causal;
    fadev_ring_params rp;
    if (!PyArg_ParseTuple(args, "LpO&", &seq, &causal, parse_ring, &rp)) return NULL;
    if (seq < 1 || seq > 8192) return PyErr_Format(PyExc_ValueError, "seq must be in 1..8192, got %lld", seq);
    npy_intp dims[2] = {(npy_intp)seq, (npy_intp)seq};
    PyArrayObject *count = (PyArrayObject *)PyArray_SimpleNew(2, dims, NPY_INT32);
    if (!count) return NULL;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_ring_coverage((int64_t)seq, causal, &rp, (int32_t *)PyArray_DATA(count));
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) {
        Py_DECREF(count);
        return raise_status(st, "ring_coverage");
    }
    return (PyObject *)count;
}

/* ------------------------------------------------------------ module */

static PyMethodDef core_methods[] = {
    {"round", py_round, METH_VARARGS, "round(x, fmt, mode, seed, stream, offset) -> float64 array"},
    {"to_bits", py_to_bits, METH_VARARGS, "to_bits(x, fmt, width) -> unsigned array"},
    {"from_bits", py_from_bits, METH_VARARGS, "from_bits(bits, fmt) -> float64 array"},
    {"format_layout", py_format_layout, METH_VARARGS, "format_layout(fmt) -> (exponent_bits, total_bits)"},
    {"count_representable", py_count_representable, METH_VARARGS, "count_representable(x, fmt) -> int"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "get_num_threads() -> int"},
    {"set_num_threads", py_set_num_threads, METH_VARARGS, "set_num_threads(n)"},
    {"cuda_info", py_cuda_info, METH_NOARGS, "cuda_info() -> dict(compiled, devices)"},
    {"cuda_round", py_cuda_round, METH_VARARGS, "cuda_round(x, fmt, mode, seed, stream, offset) -> float64 array"},
    /* metrics methods */
    {"deviation", py_deviation, METH_VARARGS, "deviation(test, ref) -> dict of metrics"},
    {"wasserstein", py_wasserstein, METH_VARARGS, "wasserstein(a, b, method) -> (w1, method_used)"},
    {"sort", py_sort, METH_VARARGS, "sort(x) -> flat float64 array in IEEE total order"},
    {"ulp_error", py_ulp_error, METH_VARARGS, "ulp_error(test, ref, fmt) -> float64 array"},
    {"ulp_histogram", py_ulp_histogram, METH_VARARGS, "ulp_histogram(test, ref, fmt, max_ulp) -> (counts, n_nan)"},
    /* attention methods */
    {"baseline_attention", py_baseline_attention, METH_VARARGS,
     "baseline_attention(q, k, v, policy, scale, causal) -> (out, lse); q, k, v 4-D"},
    {"flash_attention", py_flash_attention, METH_VARARGS,
     "flash_attention(q, k, v, policy, scale, causal, block_q, block_kv, loop_order, normalize, exp_form) -> (out, lse)"},
    {"baseline_attention_backward", py_baseline_attention_backward, METH_VARARGS,
     "baseline_attention_backward(q, k, v, out, lse, dout, policy, policy_backward, scale, causal) -> (dq, dk, dv)"},
    {"flash_attention_backward", py_flash_attention_backward, METH_VARARGS,
     "flash_attention_backward(q, k, v, out, lse, dout, policy, policy_backward, scale, causal, block_q, block_kv, "
     "exp_form) -> (dq, dk, dv)"},
    /* ring methods */
    {"ring_attention", py_ring_attention, METH_VARARGS,
     "ring_attention(q, k, v, policy, ring, scale, causal, block_q, block_kv, loop_order, normalize, exp_form) "
     "-> (out, lse)"},
    {"ring_attention_backward", py_ring_attention_backward, METH_VARARGS,
     "ring_attention_backward(q, k, v, out, lse, dout, policy, policy_backward, ring, scale, causal, block_q, "
     "block_kv, exp_form) -> (dq, dk, dv)"},
    {"ring_coverage", py_ring_coverage, METH_VARARGS, "ring_coverage(seq, causal, ring) -> int32 (seq, seq)"},
    /* hadamard methods */
    {"hadamard", py_hadamard, METH_VARARGS, "hadamard(x, signs or None, inverse) -> rotated float64 array"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {PyModuleDef_HEAD_INIT, "fadev._core", "fadev's C core (see csrc/fadev.h).",
                                         -1, core_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
    import_array();
    PyObject *module = PyModule_Create(&core_module);
    if (module && PyModule_AddFunctions(module, cuda_methods) < 0) Py_CLEAR(module);
    return module;
}
