/* fadev._core: the one thin binding between Python and the C core (with module_args.c, module_cuda.c).
 *
 * Each function here unpacks arguments, converts arrays to contiguous native float64 (or float32)
 * with NumPy, releases the GIL around the C call and turns a fadev_status into an exception that
 * names the parameter. No arithmetic happens here. The attention entry points are one entry each of one
 * dispatcher (bottleneck's shape): arrays in, the call spec (fadev._args.Call.c, parsed by module_args.c's
 * parse_call, as module_cuda.c parses it), arrays out, kernel. Argument validation
 * that needs more than a type check is done by the Python layer (fadev/), which is what users call. */
#include "module.h"

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL fadev_ARRAY_API
#include <numpy/arrayobject.h>

/* CPython passes (self, args) to every method; most of ours use neither self nor, for METH_NOARGS, args. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

#define DATA(a) PyArray_DATA((PyArrayObject *)(a))
#define SIZE(a) ((size_t)PyArray_SIZE((PyArrayObject *)(a)))

/* ------------------------------------------------------------ element-wise entry points */

/* out = fn(in[0], in[1], ...) element by element: n = size of in[0]. */
typedef fadev_status (*map_fn)(PyObject *const *in, PyObject *out, const void *options);

/* Takes the n_in arrays in (new references, or NULL after a failed conversion: then it just cleans up);
 * a new array of out_type shaped like in[0] receives fn's result, computed without the GIL. device: fn runs
 * on the GPU (its errors carry CUDA's message). */
static PyObject *map_call(PyObject **in, int n_in, int out_type, map_fn fn, const void *options, const char *what,
                          int device) {
    PyObject *out = NULL;
    fadev_status st = FADEV_OK;
    int ok = 1;
    for (int i = 0; i < n_in; i++) ok = ok && in[i];
    if (ok && (out = new_like(in[0], -1, out_type))) {
        Py_BEGIN_ALLOW_THREADS
        st = fn(in, out, options);
        Py_END_ALLOW_THREADS
    }
    for (int i = 0; i < n_in; i++) Py_XDECREF(in[i]);
    if (out && st != FADEV_OK) {
        Py_CLEAR(out);
        return device ? raise_device_status(st, what) : raise_status(st, what);
    }
    return out;
}

typedef struct round_options {
    fadev_format fmt;
    int mode, f32;
    unsigned long long seed, stream, offset;
} round_options;

static fadev_status run_round(PyObject *const *in, PyObject *out, const void *options) {
    const round_options *o = options;
    if (o->f32)
        return fadev_round_f32(DATA(in[0]), DATA(out), SIZE(in[0]), &o->fmt, o->mode, o->seed, o->stream, o->offset);
    return fadev_round_f64(DATA(in[0]), DATA(out), SIZE(in[0]), &o->fmt, o->mode, o->seed, o->stream, o->offset);
}

static fadev_status run_cuda_round(PyObject *const *in, PyObject *out, const void *options) {
    const round_options *o = options;
    return fadev_cuda_round_f64(DATA(in[0]), DATA(out), SIZE(in[0]), &o->fmt, o->mode, o->seed, o->stream, o->offset);
}

static PyObject *round_call(PyObject *args, int cuda) {
    PyObject *x;
    round_options o;
    if (!PyArg_ParseTuple(args, "OO&iKKK", &x, parse_format, &o.fmt, &o.mode, &o.seed, &o.stream, &o.offset))
        return NULL;
    o.f32 = !cuda && PyArray_Check(x) && PyArray_TYPE((PyArrayObject *)x) == NPY_FLOAT32;
    PyObject *in = as_array(x, o.f32 ? NPY_FLOAT32 : NPY_FLOAT64, "x");
    return map_call(&in, 1, NPY_FLOAT64, cuda ? run_cuda_round : run_round, &o, cuda ? "cuda round" : "round", cuda);
}

static PyObject *py_round(PyObject *self, PyObject *args) { return round_call(args, 0); }

static PyObject *py_cuda_round(PyObject *self, PyObject *args) { return round_call(args, 1); }

typedef struct bits_options {
    fadev_format fmt;
    int width;
} bits_options;

static fadev_status run_to_bits(PyObject *const *in, PyObject *out, const void *options) {
    const bits_options *o = options;
    return fadev_to_bits(DATA(in[0]), DATA(out), o->width, SIZE(in[0]), &o->fmt);
}

static fadev_status run_from_bits(PyObject *const *in, PyObject *out, const void *options) {
    const bits_options *o = options;
    return fadev_from_bits(DATA(in[0]), o->width, DATA(out), SIZE(in[0]), &o->fmt);
}

static int width_type(int width) {
    return width == 1 ? NPY_UINT8 : width == 2 ? NPY_UINT16 : width == 4 ? NPY_UINT32 : NPY_UINT64;
}

static PyObject *py_to_bits(PyObject *self, PyObject *args) {
    PyObject *x;
    bits_options o;
    if (!PyArg_ParseTuple(args, "OO&i", &x, parse_format, &o.fmt, &o.width)) return NULL;
    if (o.width != 1 && o.width != 2 && o.width != 4 && o.width != 8)
        return PyErr_Format(PyExc_ValueError, "width must be 1, 2, 4 or 8 bytes, got %d", o.width);
    PyObject *in = as_array(x, NPY_FLOAT64, "x");
    return map_call(&in, 1, width_type(o.width), run_to_bits, &o, "to_bits", 0);
}

static PyObject *py_from_bits(PyObject *self, PyObject *args) {
    PyObject *bits;
    bits_options o;
    if (!PyArg_ParseTuple(args, "OO&", &bits, parse_format, &o.fmt)) return NULL;
    if (!PyArray_Check(bits) || !PyArray_ISUNSIGNED((PyArrayObject *)bits))
        return PyErr_Format(PyExc_TypeError, "bits must be an unsigned integer array (uint8/16/32/64)");
    o.width = (int)PyArray_ITEMSIZE((PyArrayObject *)bits);
    PyObject *in = as_array(bits, width_type(o.width), "bits");
    return map_call(&in, 1, NPY_FLOAT64, run_from_bits, &o, "from_bits", 0);
}

static PyObject *py_format_layout(PyObject *self, PyObject *args) {
    fadev_format fmt;
    int k, total;
    if (!PyArg_ParseTuple(args, "O&", parse_format, &fmt)) return NULL;
    fadev_status st = fadev_format_layout(&fmt, &k, &total);
    if (st != FADEV_OK) return raise_status(st, "format_layout");
    return Py_BuildValue("ii", k, total);
}

static PyObject *py_count_representable(PyObject *self, PyObject *args) {
    PyObject *x;
    fadev_format fmt;
    if (!PyArg_ParseTuple(args, "OO&", &x, parse_format, &fmt)) return NULL;
    PyObject *a = as_array(x, NPY_FLOAT64, "x");
    if (!a) return NULL;
    size_t count = 0;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_count_representable(DATA(a), SIZE(a), &fmt, &count);
    Py_END_ALLOW_THREADS
    Py_DECREF(a);
    if (st != FADEV_OK) return raise_status(st, "count_representable");
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

/* ------------------------------------------------------------ metrics */

/* test and ref as contiguous float64 arrays (the Python layer has checked the shapes): 1, or 0 with an
 * exception and nothing held. */
static int metric_pair(PyObject *tobj, PyObject *robj, const char *tname, const char *rname, int same_size,
                       PyObject **t, PyObject **r) {
    *t = as_array(tobj, NPY_FLOAT64, tname);
    *r = *t ? as_array(robj, NPY_FLOAT64, rname) : NULL;
    if (!*r) {
    } else if (same_size && SIZE(*t) != SIZE(*r)) {
        PyErr_Format(PyExc_ValueError, "%s and %s must have the same size, got %zd and %zd", tname, rname,
                     (Py_ssize_t)SIZE(*t), (Py_ssize_t)SIZE(*r));
    } else if (SIZE(*t) == 0 || SIZE(*r) == 0) {
        PyErr_Format(PyExc_ValueError, "%s: empty array", SIZE(*t) == 0 ? tname : rname);
    } else {
        return 1;
    }
    Py_XDECREF(*t);
    Py_XDECREF(*r);
    return 0;
}

static PyObject *py_deviation(PyObject *self, PyObject *args) {
    PyObject *tobj, *robj, *t, *r;
    if (!PyArg_ParseTuple(args, "OO", &tobj, &robj)) return NULL;
    if (!metric_pair(tobj, robj, "test", "ref", 1, &t, &r)) return NULL;
    fadev_deviation dev;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_deviation_stats(DATA(t), DATA(r), SIZE(t), &dev);
    Py_END_ALLOW_THREADS
    Py_DECREF(t);
    Py_DECREF(r);
    if (st != FADEV_OK) return raise_status(st, "deviation");
    return deviation_dict(&dev);
}

/* wasserstein(a, b, method) -> (w1, method_used); method 1 (sort) takes a and b sorted (np.sort); method 0
 * (auto) returns (None, 1) when counting does not apply: sort them and call again with method 1. */
static PyObject *py_wasserstein(PyObject *self, PyObject *args) {
    PyObject *aobj, *bobj, *a, *b;
    int method;
    if (!PyArg_ParseTuple(args, "OOi", &aobj, &bobj, &method)) return NULL;
    if (!metric_pair(aobj, bobj, "a", "b", 0, &a, &b)) return NULL;
    double w = 0;
    int used = 0;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_wasserstein(DATA(a), SIZE(a), DATA(b), SIZE(b), method, &w, &used);
    Py_END_ALLOW_THREADS
    Py_DECREF(a);
    Py_DECREF(b);
    if (st == FADEV_ERR_NOT_REPRESENTABLE)
        return PyErr_Format(PyExc_ValueError, "method='count' needs every value of a and b to be a finite "
                                              "bf16 number, or every value a finite fp16 number");
    if (st != FADEV_OK) return raise_status(st, "wasserstein");
    if (method == FADEV_W1_AUTO && used == FADEV_W1_SORT) return Py_BuildValue("(Oi)", Py_None, used);
    return Py_BuildValue("(di)", w, used);
}

typedef struct ulp_options {
    fadev_format fmt;
} ulp_options;

static fadev_status run_ulp_error(PyObject *const *in, PyObject *out, const void *options) {
    return fadev_ulp_error(DATA(in[0]), DATA(in[1]), SIZE(in[0]), &((const ulp_options *)options)->fmt, DATA(out));
}

static PyObject *py_ulp_error(PyObject *self, PyObject *args) {
    PyObject *tobj, *robj, *in[2];
    ulp_options o;
    if (!PyArg_ParseTuple(args, "OOO&", &tobj, &robj, parse_format, &o.fmt)) return NULL;
    if (!metric_pair(tobj, robj, "test", "ref", 1, &in[0], &in[1])) return NULL;
    return map_call(in, 2, NPY_FLOAT64, run_ulp_error, &o, "ulp_error", 0);
}

static PyObject *py_ulp_histogram(PyObject *self, PyObject *args) {
    PyObject *tobj, *robj, *t, *r;
    fadev_format fmt;
    Py_ssize_t max_ulp;
    if (!PyArg_ParseTuple(args, "OOO&n", &tobj, &robj, parse_format, &fmt, &max_ulp)) return NULL;
    if (max_ulp < 1 || max_ulp > (1 << 20))
        return PyErr_Format(PyExc_ValueError, "max_ulp must be in 1..2^20, got %zd", max_ulp);
    if (!metric_pair(tobj, robj, "test", "ref", 1, &t, &r)) return NULL;
    npy_intp len = (npy_intp)max_ulp + 1;
    PyObject *counts = PyArray_SimpleNew(1, &len, NPY_UINT64);
    uint64_t n_nan = 0;
    fadev_status st = FADEV_OK;
    if (counts) {
        Py_BEGIN_ALLOW_THREADS
        st = fadev_ulp_histogram(DATA(t), DATA(r), SIZE(t), &fmt, (size_t)max_ulp, DATA(counts), &n_nan);
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

/* ------------------------------------------------------------ attention: one table, one dispatcher */

/* in: q, k, v (forward) or q, k, v, out, lse, dout (backward); out: out, lse or dq, dk, dv. */
typedef fadev_status (*attention_fn)(const double *const *in, double *const *out, const call_options *c);

static fadev_status run_baseline(const double *const *in, double *const *out, const call_options *c) {
    return fadev_baseline_attention(in[0], in[1], in[2], out[0], out[1], &c->pr, &c->policy);
}

static fadev_status run_flash(const double *const *in, double *const *out, const call_options *c) {
    return fadev_flash_attention(in[0], in[1], in[2], out[0], out[1], &c->pr, &c->policy);
}

static fadev_status run_ring(const double *const *in, double *const *out, const call_options *c) {
    return fadev_ring_attention(in[0], in[1], in[2], out[0], out[1], &c->pr, &c->policy, &c->ring);
}

static fadev_status run_baseline_backward(const double *const *in, double *const *out, const call_options *c) {
    return fadev_baseline_attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], out[0], out[1], out[2], &c->pr,
                                             &c->policy, &c->policy_backward);
}

static fadev_status run_flash_backward(const double *const *in, double *const *out, const call_options *c) {
    return fadev_flash_attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], out[0], out[1], out[2], &c->pr,
                                          &c->policy, &c->policy_backward);
}

static fadev_status run_ring_backward(const double *const *in, double *const *out, const call_options *c) {
    return fadev_ring_attention_backward(in[0], in[1], in[2], in[3], in[4], in[5], out[0], out[1], out[2], &c->pr,
                                         &c->policy, &c->policy_backward, &c->ring);
}

typedef struct attention_entry {
    const char *name;
    int backward; /* 0: 3 arrays in, (out, lse) out; 1: 6 in, (dq, dk, dv) out; then the call spec */
    int needs;    /* what of the call spec it reads (enum call_needs) */
    attention_fn run;
} attention_entry;

#define POLICIES (NEEDS_POLICY | NEEDS_POLICY_BACKWARD)

static const attention_entry baseline_entry = {"baseline_attention", 0, NEEDS_POLICY, run_baseline};
static const attention_entry flash_entry = {"flash_attention", 0, NEEDS_POLICY, run_flash};
static const attention_entry ring_entry = {"ring_attention", 0, NEEDS_POLICY | NEEDS_RING, run_ring};
static const attention_entry baseline_backward_entry = {"baseline_attention_backward", 1, POLICIES,
                                                        run_baseline_backward};
static const attention_entry flash_backward_entry = {"flash_attention_backward", 1, POLICIES, run_flash_backward};
static const attention_entry ring_backward_entry = {"ring_attention_backward", 1, POLICIES | NEEDS_RING,
                                                    run_ring_backward};

static const char *const array_names[6] = {"q", "k", "v", "out", "lse", "dout"};

/* 1 if the arrays' ranks and shapes agree (q, out, dout (B, H, Nq, D); k, v (B, Hkv, Nk, D); lse (B, H, Nq)),
 * with the shapes written into c->pr; else 0 with ValueError. */
static int attention_shapes(PyObject *const *a, int n, const char *what, fadev_attention_params *pr) {
    for (int x = 0; x < n; x++) {
        int rank = x == 4 ? 3 : 4, got = PyArray_NDIM((PyArrayObject *)a[x]);
        if (got != rank) {
            PyErr_Format(PyExc_ValueError, "%s: %s must be %d-D, got %d-D", what, array_names[x], rank, got);
            return 0;
        }
    }
    const npy_intp *qs = PyArray_DIMS((PyArrayObject *)a[0]), *ks = PyArray_DIMS((PyArrayObject *)a[1]),
                   *vs = PyArray_DIMS((PyArrayObject *)a[2]);
    int agree = ks[0] == qs[0] && ks[3] == qs[3];
    for (int d = 0; d < 4; d++) agree = agree && vs[d] == ks[d];
    if (n == 6) {
        const npy_intp *os = PyArray_DIMS((PyArrayObject *)a[3]), *ls = PyArray_DIMS((PyArrayObject *)a[4]),
                       *gs = PyArray_DIMS((PyArrayObject *)a[5]);
        for (int d = 0; d < 4; d++) agree = agree && os[d] == qs[d] && gs[d] == qs[d] && (d == 3 || ls[d] == qs[d]);
        if (!agree)
            PyErr_Format(PyExc_ValueError, "%s: shapes do not agree: q (%zd, %zd, %zd, %zd), k (%zd, %zd, %zd, %zd), "
                         "v (%zd, %zd, %zd, %zd), lse (%zd, %zd, %zd); out and dout must be shaped like q", what,
                         qs[0], qs[1], qs[2], qs[3], ks[0], ks[1], ks[2], ks[3], vs[0], vs[1], vs[2], vs[3], ls[0],
                         ls[1], ls[2]);
    } else if (!agree) {
        PyErr_Format(PyExc_ValueError, "%s: shapes do not agree: q (%zd, %zd, %zd, %zd), k (%zd, %zd, %zd, %zd), "
                     "v (%zd, %zd, %zd, %zd)", what, qs[0], qs[1], qs[2], qs[3], ks[0], ks[1], ks[2], ks[3], vs[0],
                     vs[1], vs[2], vs[3]);
    }
    pr->batch = qs[0], pr->heads = qs[1], pr->seq_q = qs[2], pr->dim = qs[3];
    pr->heads_kv = ks[1], pr->seq_kv = ks[2];
    return agree;
}

/* The one dispatcher of the host-array attention entry points: the arrays, then the call spec (parse_call), unpacked
 * as the entry says, outputs allocated, the kernel run without the GIL, the status translated. */
static PyObject *attention_call(const attention_entry *e, PyObject *args) {
    const int n_in = e->backward ? 6 : 3, n_out = e->backward ? 3 : 2;
    PyObject *in[6] = {NULL}, *out[3] = {NULL}, *result = NULL;
    call_options c;
    if (PyTuple_GET_SIZE(args) != n_in + 1)
        return PyErr_Format(PyExc_TypeError, "%s() takes exactly %d arguments (%zd given): %d arrays and the call spec",
                            e->name, n_in + 1, PyTuple_GET_SIZE(args), n_in);
    if (!parse_call(PyTuple_GET_ITEM(args, n_in), e->needs, &c, e->name)) return NULL;
    for (int x = 0; x < n_in; x++)
        if (!(in[x] = as_array(PyTuple_GET_ITEM(args, x), NPY_FLOAT64, array_names[x]))) goto done;
    if (!attention_shapes(in, n_in, e->name, &c.pr)) goto done;
    for (int x = 0; x < n_out; x++) /* out like q, lse like q without D; dq, dk, dv like q, k, v */
        if (!(out[x] = new_like(in[e->backward ? x : 0], !e->backward && x == 1 ? 3 : -1, NPY_FLOAT64))) goto done;
    const double *src[6];
    double *dst[3];
    for (int x = 0; x < n_in; x++) src[x] = DATA(in[x]);
    for (int x = 0; x < n_out; x++) dst[x] = DATA(out[x]);
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = e->run(src, dst, &c);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) raise_status(st, e->name);
    else result = n_out == 2 ? PyTuple_Pack(2, out[0], out[1]) : PyTuple_Pack(3, out[0], out[1], out[2]);
done:
    for (int x = 0; x < n_in; x++) Py_XDECREF(in[x]);
    for (int x = 0; x < n_out; x++) Py_XDECREF(out[x]);
    return result;
}

#define ATTENTION_METHOD(kernel) \
    static PyObject *py_##kernel(PyObject *self, PyObject *args) { return attention_call(&kernel##_entry, args); }
ATTENTION_METHOD(baseline)
ATTENTION_METHOD(flash)
ATTENTION_METHOD(ring)
ATTENTION_METHOD(baseline_backward)
ATTENTION_METHOD(flash_backward)
ATTENTION_METHOD(ring_backward)

static PyObject *py_ring_coverage(PyObject *self, PyObject *args) {
    long long seq;
    int causal;
    fadev_ring_params rp;
    if (!PyArg_ParseTuple(args, "LpO&", &seq, &causal, parse_ring, &rp)) return NULL;
    if (seq < 1 || seq > 8192) return PyErr_Format(PyExc_ValueError, "seq must be in 1..8192, got %lld", seq);
    npy_intp dims[2] = {(npy_intp)seq, (npy_intp)seq};
    PyObject *count = PyArray_SimpleNew(2, dims, NPY_INT32);
    if (!count) return NULL;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_ring_coverage((int64_t)seq, causal, &rp, DATA(count));
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) {
        Py_DECREF(count);
        return raise_status(st, "ring_coverage");
    }
    return count;
}

/* ring_merge(out, lse, seen, ob, lb, (partial_lse, merge, running_out, running_lse)) -> (out, lse, seen): ring.c's
 * merge of one piece (ob rows x D, lb rows) into copies of a rank's running rows (out rows x D, lse and seen rows;
 * seen as uint8). */
static PyObject *py_ring_merge(PyObject *self, PyObject *args) {
    PyObject *obj[5], *a[5] = {NULL}, *result = NULL;
    fadev_ring_params rp;
    memset(&rp, 0, sizeof rp);
    static const char *const names[5] = {"out", "lse", "seen", "ob", "lb"};
    if (!PyArg_ParseTuple(args, "OOOOO(O&O&O&O&);formats must be (partial_lse, merge, running_out, running_lse)",
                          &obj[0], &obj[1], &obj[2], &obj[3], &obj[4], parse_format, &rp.partial_lse, parse_format,
                          &rp.merge, parse_format, &rp.running_out, parse_format, &rp.running_lse))
        return NULL;
    for (int x = 0; x < 5; x++)
        if (!(a[x] = as_array(obj[x], x == 2 ? NPY_UINT8 : NPY_FLOAT64, names[x]))) goto done;
    const int ndim = PyArray_NDIM((PyArrayObject *)a[0]);
    const int64_t dim = ndim ? (int64_t)PyArray_DIM((PyArrayObject *)a[0], ndim - 1) : 0;
    const int64_t rows = dim ? (int64_t)SIZE(a[0]) / dim : 0;
    if (dim < 1 || SIZE(a[3]) != SIZE(a[0]) || (int64_t)SIZE(a[1]) != rows || (int64_t)SIZE(a[2]) != rows ||
        (int64_t)SIZE(a[4]) != rows) {
        PyErr_Format(PyExc_ValueError, "ring_merge: out and ob must be (rows, D) alike, lse, seen and lb hold rows");
        goto done;
    }
    for (int x = 0; x < 3; x++) { /* the results: fresh copies (as_array may have returned the caller's array) */
        PyObject *copy = PyArray_NewCopy((PyArrayObject *)a[x], NPY_CORDER);
        Py_SETREF(a[x], copy);
        if (!copy) goto done;
    }
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_ring_merge(DATA(a[0]), DATA(a[1]), DATA(a[2]), DATA(a[3]), DATA(a[4]), rows, dim, &rp);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) raise_status(st, "ring_merge");
    else result = PyTuple_Pack(3, a[0], a[1], a[2]);
done:
    for (int x = 0; x < 5; x++) Py_XDECREF(a[x]);
    return result;
}

/* ------------------------------------------------------------ hadamard */

typedef struct hadamard_options {
    const double *signs;
    size_t dim;
    int inverse;
} hadamard_options;

static fadev_status run_hadamard(PyObject *const *in, PyObject *out, const void *options) {
    const hadamard_options *o = options;
    return fadev_hadamard_f64(DATA(in[0]), DATA(out), SIZE(in[0]) / o->dim, o->dim, o->signs, o->inverse);
}

/* hadamard(x, signs or None, inverse): x (..., D) float64 -> rotated copy of the same shape. */
static PyObject *py_hadamard(PyObject *self, PyObject *args) {
    PyObject *xobj, *sobj, *x, *s = NULL, *result = NULL;
    hadamard_options o = {NULL, 0, 0};
    if (!PyArg_ParseTuple(args, "OOp", &xobj, &sobj, &o.inverse)) return NULL;
    if (!(x = as_array(xobj, NPY_FLOAT64, "x"))) return NULL;
    int ndim = PyArray_NDIM((PyArrayObject *)x);
    if (ndim < 1 || SIZE(x) == 0) {
        PyErr_Format(PyExc_ValueError, "x: expected a non-empty array of at least 1 dimension");
        goto done;
    }
    o.dim = (size_t)PyArray_DIM((PyArrayObject *)x, ndim - 1);
    if (sobj != Py_None) {
        if (!(s = as_array(sobj, NPY_FLOAT64, "signs"))) goto done;
        if (PyArray_NDIM((PyArrayObject *)s) != 1 || SIZE(s) != o.dim) {
            PyErr_Format(PyExc_ValueError, "signs: expected shape (%zu,), got %zd elements in %d dimension(s)", o.dim,
                         (Py_ssize_t)SIZE(s), PyArray_NDIM((PyArrayObject *)s));
            goto done;
        }
        o.signs = DATA(s);
    }
    Py_INCREF(x); /* map_call takes one reference */
    result = map_call(&x, 1, NPY_FLOAT64, run_hadamard, &o, "hadamard (dim must be a power of two, signs +-1)", 0);
done:
    Py_DECREF(x);
    Py_XDECREF(s);
    return result;
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
    {"wasserstein", py_wasserstein, METH_VARARGS,
     "wasserstein(a, b, method) -> (w1, method_used); method 1 (sort) needs a and b sorted (np.sort); method 0 "
     "(auto) gives (None, 1) when they must be sorted and passed again with method 1"},
    {"ulp_error", py_ulp_error, METH_VARARGS, "ulp_error(test, ref, fmt) -> float64 array"},
    {"ulp_histogram", py_ulp_histogram, METH_VARARGS, "ulp_histogram(test, ref, fmt, max_ulp) -> (counts, n_nan)"},
    /* attention methods: the arrays, then the call spec (fadev._args.Call.c) */
    {"baseline_attention", py_baseline, METH_VARARGS, "baseline_attention(q, k, v, call) -> (out, lse); q, k, v 4-D"},
    {"flash_attention", py_flash, METH_VARARGS, "flash_attention(q, k, v, call) -> (out, lse)"},
    {"baseline_attention_backward", py_baseline_backward, METH_VARARGS,
     "baseline_attention_backward(q, k, v, out, lse, dout, call) -> (dq, dk, dv)"},
    {"flash_attention_backward", py_flash_backward, METH_VARARGS,
     "flash_attention_backward(q, k, v, out, lse, dout, call) -> (dq, dk, dv)"},
    /* ring methods */
    {"ring_attention", py_ring, METH_VARARGS, "ring_attention(q, k, v, call) -> (out, lse); call with a ring"},
    {"ring_attention_backward", py_ring_backward, METH_VARARGS,
     "ring_attention_backward(q, k, v, out, lse, dout, call) -> (dq, dk, dv); call with a ring"},
    {"ring_merge", py_ring_merge, METH_VARARGS,
     "ring_merge(out, lse, seen, ob, lb, (partial_lse, merge, running_out, running_lse)) -> (out, lse, seen uint8)"},
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
    if (module && PyModule_AddFunctions(module, fast_methods) < 0) Py_CLEAR(module);
    return module;
}
