/* fadev._core's CUDA methods: the binding for the device-pointer entry points of fadev.h ("CUDA").
 *
 * Device memory arrives as Python ints (the address, as __cuda_array_interface__ and torch's data_ptr()
 * give it; 0 is NULL); host memory for copies as buffer objects (contiguous NumPy arrays). Shapes and
 * options arrive as tuples built by fadev/cuda.py, policies and formats as the tuples module.c parses
 * (parse_policy, parse_policy_backward, parse_format from module.h). The Python layer validated and
 * allocated everything; this file only unpacks, releases the GIL around each CUDA call and turns a
 * status into an exception (raise_status: FADEV_ERR_CUDA -> RuntimeError with CUDA's message, CUDA's out
 * of memory -> MemoryError, FADEV_ERR_NO_CUDA -> RuntimeError). Every call is synchronous: the C side
 * runs on the legacy default stream and synchronises before returning. */
#include "module.h"

/* CPython passes (self, args) to every method; most of ours use neither self nor, for METH_NOARGS, args. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

/* ------------------------------------------------------------ converters */

/* A device address: a non-negative Python int (0 means NULL). */
static int parse_ptr(PyObject *obj, void *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a device pointer must be an int, got %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(obj);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    *(void **)out = (void *)(uintptr_t)address;
    return 1;
}

/* fadev_attention_params from (batch, heads, heads_kv, seq_q, seq_kv, dim, scale, causal, block_q, block_kv,
 * loop_order, normalize, exp_form). */
static int parse_params(PyObject *obj, void *out) {
    fadev_attention_params *pr = (fadev_attention_params *)out;
    long long b, h, hkv, nq, nk, d;
    int causal, block_q, block_kv, loop_order, normalize, exp_form;
    memset(pr, 0, sizeof *pr);
    if (!PyArg_ParseTuple(obj, "LLLLLLdpiiiii;params must be (batch, heads, heads_kv, seq_q, seq_kv, dim, scale, "
                               "causal, block_q, block_kv, loop_order, normalize, exp_form)", &b, &h, &hkv, &nq, &nk,
                          &d, &pr->scale, &causal, &block_q, &block_kv, &loop_order, &normalize, &exp_form))
        return 0;
    pr->batch = b, pr->heads = h, pr->heads_kv = hkv, pr->seq_q = nq, pr->seq_kv = nk, pr->dim = d;
    pr->causal = causal, pr->block_q = block_q, pr->block_kv = block_kv;
    pr->loop_order = loop_order, pr->normalize = normalize, pr->exp_form = exp_form;
    return 1;
}

/* fadev_native_params from (batch, heads, heads_kv, seq_q, seq_kv, dim, scale, causal, block_q, block_kv, dtype). */
static int parse_native_params(PyObject *obj, void *out) {
    fadev_native_params *np = (fadev_native_params *)out;
    long long b, h, hkv, nq, nk, d;
    int causal, block_q, block_kv, dtype;
    memset(np, 0, sizeof *np);
    if (!PyArg_ParseTuple(obj, "LLLLLLdpiii;native params must be (batch, heads, heads_kv, seq_q, seq_kv, dim, "
                               "scale, causal, block_q, block_kv, dtype)", &b, &h, &hkv, &nq, &nk, &d, &np->scale,
                          &causal, &block_q, &block_kv, &dtype))
        return 0;
    np->batch = b, np->heads = h, np->heads_kv = hkv, np->seq_q = nq, np->seq_kv = nk, np->dim = d;
    np->causal = causal, np->block_q = block_q, np->block_kv = block_kv, np->dtype = dtype;
    return 1;
}

/* ------------------------------------------------------------ memory */

static PyObject *py_cuda_malloc(PyObject *self, PyObject *args) {
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "n", &bytes)) return NULL;
    if (bytes < 0) return PyErr_Format(PyExc_ValueError, "bytes must be >= 0, got %zd", bytes);
    void *ptr = NULL;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_malloc(&ptr, (size_t)bytes);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "cuda_malloc");
    return PyLong_FromVoidPtr(ptr);
}

static PyObject *py_cuda_free(PyObject *self, PyObject *args) {
    void *ptr;
    if (!PyArg_ParseTuple(args, "O&", parse_ptr, &ptr)) return NULL;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_free(ptr);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "cuda_free");
    Py_RETURN_NONE;
}

/* One copy between a host buffer and device memory (kind 0: host -> device, 1: device -> host) of the
 * buffer's whole length. */
static PyObject *host_copy(PyObject *args, int kind) {
    void *device;
    Py_buffer host;
    const char *what = kind == 0 ? "cuda_upload" : "cuda_download";
    if (kind == 0 ? !PyArg_ParseTuple(args, "O&y*", parse_ptr, &device, &host)
                  : !PyArg_ParseTuple(args, "w*O&", &host, parse_ptr, &device))
        return NULL;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 0)
        st = fadev_cuda_memcpy(device, host.buf, (size_t)host.len, 0);
    else
        st = fadev_cuda_memcpy(host.buf, device, (size_t)host.len, 1);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&host);
    if (st != FADEV_OK) return raise_status(st, what);
    Py_RETURN_NONE;
}

static PyObject *py_cuda_upload(PyObject *self, PyObject *args) { return host_copy(args, 0); }

static PyObject *py_cuda_download(PyObject *self, PyObject *args) { return host_copy(args, 1); }

static PyObject *py_cuda_copy(PyObject *self, PyObject *args) {
    void *dst, *src;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "O&O&n", parse_ptr, &dst, parse_ptr, &src, &bytes)) return NULL;
    if (bytes < 0) return PyErr_Format(PyExc_ValueError, "bytes must be >= 0, got %zd", bytes);
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_memcpy(dst, src, (size_t)bytes, 2);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "cuda_copy");
    Py_RETURN_NONE;
}

/* Every entry point synchronises the device before returning (fadev.h), so an empty copy is a
 * device-wide barrier: work queued on other streams (another library's) is finished after it. */
static PyObject *py_cuda_synchronize(PyObject *self, PyObject *args) {
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_memcpy(NULL, NULL, 0, 2);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "cuda_synchronize");
    Py_RETURN_NONE;
}

static PyObject *py_cuda_pointer_device(PyObject *self, PyObject *args) {
    void *ptr;
    if (!PyArg_ParseTuple(args, "O&", parse_ptr, &ptr)) return NULL;
    int device = -1;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_pointer_device(ptr, &device);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "cuda_pointer_device");
    return PyLong_FromLong(device);
}

/* ------------------------------------------------------------ emulated and golden attention */

enum cuda_kernel { CUDA_BASELINE = 0, CUDA_FLASH = 1, CUDA_GOLDEN = 2 };
static const char *const kernel_names[3] = {"baseline_attention (cuda)", "flash_attention (cuda)",
                                            "golden_attention (cuda)"};

/* cuda_attention(kernel, q, k, v, out, lse, params, policy or None): kernel 0 baseline, 1 flash, 2 golden
 * (no policy). lse may be 0. */
static PyObject *py_cuda_attention(PyObject *self, PyObject *args) {
    int kernel;
    void *q, *k, *v, *out, *lse;
    fadev_attention_params pr;
    PyObject *policy;
    fadev_policy pol;
    if (!PyArg_ParseTuple(args, "iO&O&O&O&O&O&O", &kernel, parse_ptr, &q, parse_ptr, &k, parse_ptr, &v, parse_ptr,
                          &out, parse_ptr, &lse, parse_params, &pr, &policy))
        return NULL;
    if (kernel < CUDA_BASELINE || kernel > CUDA_GOLDEN)
        return PyErr_Format(PyExc_ValueError, "kernel must be 0 (baseline), 1 (flash) or 2 (golden), got %d", kernel);
    if (kernel != CUDA_GOLDEN && !parse_policy(policy, &pol)) return NULL;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    if (kernel == CUDA_BASELINE)
        st = fadev_cuda_baseline_attention(q, k, v, out, lse, &pr, &pol);
    else if (kernel == CUDA_FLASH)
        st = fadev_cuda_flash_attention(q, k, v, out, lse, &pr, &pol);
    else
        st = fadev_cuda_golden_attention(q, k, v, out, lse, &pr);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, kernel_names[kernel]);
    Py_RETURN_NONE;
}

/* cuda_attention_backward(kernel, q, k, v, out, lse, dout, dq, dk, dv, params, policy, policy_backward):
 * kernel 0 baseline, 1 flash. */
static PyObject *py_cuda_attention_backward(PyObject *self, PyObject *args) {
    int kernel;
    void *a[9];
    fadev_attention_params pr;
    fadev_policy pol;
    fadev_policy_backward pb;
    if (!PyArg_ParseTuple(args, "iO&O&O&O&O&O&O&O&O&O&O&O&", &kernel, parse_ptr, &a[0], parse_ptr, &a[1], parse_ptr,
                          &a[2], parse_ptr, &a[3], parse_ptr, &a[4], parse_ptr, &a[5], parse_ptr, &a[6], parse_ptr,
                          &a[7], parse_ptr, &a[8], parse_params, &pr, parse_policy, &pol, parse_policy_backward, &pb))
        return NULL;
    if (kernel != CUDA_BASELINE && kernel != CUDA_FLASH)
        return PyErr_Format(PyExc_ValueError, "kernel must be 0 (baseline) or 1 (flash), got %d", kernel);
    const double *q = a[0], *k = a[1], *v = a[2], *out = a[3], *lse = a[4], *dout = a[5];
    double *dq = a[6], *dk = a[7], *dv = a[8];
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    if (kernel == CUDA_FLASH)
        st = fadev_cuda_flash_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, &pr, &pol, &pb);
    else
        st = fadev_cuda_baseline_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, &pr, &pol, &pb);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK)
        return raise_status(st, kernel == CUDA_FLASH ? "flash_attention_backward (cuda)"
                                                     : "baseline_attention_backward (cuda)");
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ metrics */

static PyObject *py_cuda_deviation(PyObject *self, PyObject *args) {
    void *test, *ref;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "O&O&n", parse_ptr, &test, parse_ptr, &ref, &n)) return NULL;
    if (n < 1) return PyErr_Format(PyExc_ValueError, "n must be >= 1, got %zd", n);
    fadev_deviation dev;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_deviation_stats(test, ref, (size_t)n, &dev);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "deviation (cuda)");
    return deviation_dict(&dev);
}

static PyObject *py_cuda_wasserstein(PyObject *self, PyObject *args) {
    void *a, *b;
    Py_ssize_t n_a, n_b;
    if (!PyArg_ParseTuple(args, "O&nO&n", parse_ptr, &a, &n_a, parse_ptr, &b, &n_b)) return NULL;
    if (n_a < 1 || n_b < 1) return PyErr_Format(PyExc_ValueError, "n_a and n_b must be >= 1, got %zd, %zd", n_a, n_b);
    double w = 0;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_wasserstein(a, (size_t)n_a, b, (size_t)n_b, &w);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "wasserstein (cuda)");
    return PyFloat_FromDouble(w);
}

static PyObject *py_cuda_ulp_error(PyObject *self, PyObject *args) {
    void *test, *ref, *out;
    Py_ssize_t n;
    fadev_format fmt;
    if (!PyArg_ParseTuple(args, "O&O&nO&O&", parse_ptr, &test, parse_ptr, &ref, &n, parse_format, &fmt, parse_ptr,
                          &out))
        return NULL;
    if (n < 1) return PyErr_Format(PyExc_ValueError, "n must be >= 1, got %zd", n);
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_ulp_error(test, ref, (size_t)n, &fmt, out);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "ulp_error (cuda)");
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ native kernels */

#define MAX_NATIVE_TILES 64

static PyObject *py_cuda_native_tiles(PyObject *self, PyObject *args) {
    int dim, count = 0;
    int32_t tiles[2 * MAX_NATIVE_TILES];
    if (!PyArg_ParseTuple(args, "i", &dim)) return NULL;
    fadev_status st = fadev_cuda_native_tiles(dim, tiles, MAX_NATIVE_TILES, &count);
    if (st != FADEV_OK) return raise_status(st, "native_tiles (cuda)");
    if (count > MAX_NATIVE_TILES) count = MAX_NATIVE_TILES;
    PyObject *list = PyList_New(0);
    for (int i = 0; list && i < count; i++) {
        PyObject *pair = Py_BuildValue("(ii)", (int)tiles[2 * i], (int)tiles[2 * i + 1]);
        if (!pair || PyList_Append(list, pair) < 0) Py_CLEAR(list);
        Py_XDECREF(pair);
    }
    return list;
}

static PyObject *py_cuda_native_workspace(PyObject *self, PyObject *args) {
    fadev_native_params np;
    if (!PyArg_ParseTuple(args, "O&", parse_native_params, &np)) return NULL;
    return PyLong_FromSize_t(fadev_cuda_native_workspace(&np));
}

/* cuda_native_forward(q, k, v, out, lse, native_params) */
static PyObject *py_cuda_native_forward(PyObject *self, PyObject *args) {
    void *q, *k, *v, *out, *lse;
    fadev_native_params np;
    if (!PyArg_ParseTuple(args, "O&O&O&O&O&O&", parse_ptr, &q, parse_ptr, &k, parse_ptr, &v, parse_ptr, &out,
                          parse_ptr, &lse, parse_native_params, &np))
        return NULL;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_native_forward(q, k, v, out, lse, &np);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "native_attention (cuda)");
    Py_RETURN_NONE;
}

/* cuda_native_backward(q, k, v, out, lse, dout, dq, dk, dv, workspace, native_params) */
static PyObject *py_cuda_native_backward(PyObject *self, PyObject *args) {
    void *a[10];
    fadev_native_params np;
    if (!PyArg_ParseTuple(args, "O&O&O&O&O&O&O&O&O&O&O&", parse_ptr, &a[0], parse_ptr, &a[1], parse_ptr, &a[2],
                          parse_ptr, &a[3], parse_ptr, &a[4], parse_ptr, &a[5], parse_ptr, &a[6], parse_ptr, &a[7],
                          parse_ptr, &a[8], parse_ptr, &a[9], parse_native_params, &np))
        return NULL;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_native_backward(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], &np);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_status(st, "native_attention_backward (cuda)");
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ method table */

PyMethodDef cuda_methods[] = {
    {"cuda_malloc", py_cuda_malloc, METH_VARARGS, "cuda_malloc(bytes) -> device pointer (int)"},
    {"cuda_free", py_cuda_free, METH_VARARGS, "cuda_free(ptr)"},
    {"cuda_upload", py_cuda_upload, METH_VARARGS, "cuda_upload(dst_ptr, host_buffer): copy the whole buffer"},
    {"cuda_download", py_cuda_download, METH_VARARGS, "cuda_download(host_buffer, src_ptr): fill the whole buffer"},
    {"cuda_copy", py_cuda_copy, METH_VARARGS, "cuda_copy(dst_ptr, src_ptr, bytes): device to device"},
    {"cuda_synchronize", py_cuda_synchronize, METH_NOARGS, "cuda_synchronize(): wait for all work on the device"},
    {"cuda_pointer_device", py_cuda_pointer_device, METH_VARARGS,
     "cuda_pointer_device(ptr) -> device index owning ptr, -1 for host memory"},
    {"cuda_attention", py_cuda_attention, METH_VARARGS,
     "cuda_attention(kernel, q, k, v, out, lse, params, policy) with kernel 0 baseline, 1 flash, 2 golden (policy "
     "None); params (B, H, Hkv, Nq, Nk, D, scale, causal, block_q, block_kv, loop_order, normalize, exp_form)"},
    {"cuda_attention_backward", py_cuda_attention_backward, METH_VARARGS,
     "cuda_attention_backward(kernel, q, k, v, out, lse, dout, dq, dk, dv, params, policy, policy_backward) with "
     "kernel 0 baseline, 1 flash"},
    {"cuda_deviation", py_cuda_deviation, METH_VARARGS, "cuda_deviation(test, ref, n) -> dict of metrics"},
    {"cuda_wasserstein", py_cuda_wasserstein, METH_VARARGS, "cuda_wasserstein(a, n_a, b, n_b) -> w1"},
    {"cuda_ulp_error", py_cuda_ulp_error, METH_VARARGS, "cuda_ulp_error(test, ref, n, fmt, out)"},
    {"cuda_native_tiles", py_cuda_native_tiles, METH_VARARGS, "cuda_native_tiles(dim) -> [(block_q, block_kv), ...]"},
    {"cuda_native_workspace", py_cuda_native_workspace, METH_VARARGS,
     "cuda_native_workspace(native_params) -> bytes of float32 workspace the backward needs"},
    {"cuda_native_forward", py_cuda_native_forward, METH_VARARGS,
     "cuda_native_forward(q, k, v, out, lse, native_params); native_params (B, H, Hkv, Nq, Nk, D, scale, causal, "
     "block_q, block_kv, dtype)"},
    {"cuda_native_backward", py_cuda_native_backward, METH_VARARGS,
     "cuda_native_backward(q, k, v, out, lse, dout, dq, dk, dv, workspace, native_params)"},
    {NULL, NULL, 0, NULL},
};
