/* fadev._core's CUDA methods: the binding for the device-pointer entry points of fadev.h ("CUDA").
 *
 * Device memory arrives as Python ints (the address, as __cuda_array_interface__ and torch's data_ptr()
 * give it; 0 is NULL); host memory for copies as buffer objects (contiguous NumPy arrays). A kernel's pointers are
 * followed by its shape tuple (batch, heads, heads_kv, seq_q, seq_kv, dim), the call spec (fadev._args.Call.c,
 * parsed by module_args.c's parse_call as module.c parses it) and, for the native kernels, their own options.
 * The Python layer validated and allocated everything; this file only unpacks, releases the GIL around
 * each CUDA call and turns a status into an exception (raise_device_status: FADEV_ERR_CUDA -> RuntimeError
 * with CUDA's message, out of device memory (FADEV_ERR_NO_MEMORY) -> MemoryError with it, FADEV_ERR_NO_CUDA
 * -> RuntimeError). Each kernel is one entry, named by its method (no kernel numbers), run by one dispatcher. Every call is synchronous:
 * the C side runs on the legacy default stream and synchronises before returning -- except a native call whose
 * options name a stream, 0 included (fadev.torch_native's path): its kernels are queued there and it returns at once;
 * and an emulated call (flash, baseline, forward or backward) given a trailing stream argument, which must be 0 (the
 * legacy default stream, PyTorch's default; fadev.cuda passes it for PyTorch tensors there): its kernels stay queued. */
#include "module.h"

/* CPython passes (self, args) to every method; most of ours use neither self nor, for METH_NOARGS, args. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

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
    if (st != FADEV_OK) return raise_device_status(st, "cuda_malloc");
    return PyLong_FromVoidPtr(ptr);
}

static PyObject *py_cuda_free(PyObject *self, PyObject *args) {
    void *ptr;
    if (!PyArg_ParseTuple(args, "O&", parse_ptr, &ptr)) return NULL;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_free(ptr);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_device_status(st, "cuda_free");
    Py_RETURN_NONE;
}

/* One copy of `bytes` bytes (kind 0: host -> device, 1: device -> host, 2: device -> device). */
static PyObject *copy_call(void *dst, const void *src, size_t bytes, int kind, const char *what) {
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_memcpy(dst, src, bytes, kind);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_device_status(st, what);
    Py_RETURN_NONE;
}

/* cuda_upload(dst_ptr, host) / cuda_download(host, src_ptr): the host buffer's whole length. */
static PyObject *host_copy(PyObject *args, int kind) {
    void *device;
    Py_buffer host;
    if (kind == 0 ? !PyArg_ParseTuple(args, "O&y*", parse_ptr, &device, &host)
                  : !PyArg_ParseTuple(args, "w*O&", &host, parse_ptr, &device))
        return NULL;
    PyObject *result = kind == 0 ? copy_call(device, host.buf, (size_t)host.len, 0, "cuda_upload")
                                 : copy_call(host.buf, device, (size_t)host.len, 1, "cuda_download");
    PyBuffer_Release(&host);
    return result;
}

static PyObject *py_cuda_upload(PyObject *self, PyObject *args) { return host_copy(args, 0); }

static PyObject *py_cuda_download(PyObject *self, PyObject *args) { return host_copy(args, 1); }

static PyObject *py_cuda_copy(PyObject *self, PyObject *args) {
    void *dst, *src;
    Py_ssize_t bytes;
    if (!PyArg_ParseTuple(args, "O&O&n", parse_ptr, &dst, parse_ptr, &src, &bytes)) return NULL;
    if (bytes < 0) return PyErr_Format(PyExc_ValueError, "bytes must be >= 0, got %zd", bytes);
    return copy_call(dst, src, (size_t)bytes, 2, "cuda_copy");
}

/* Every entry point synchronises the device before returning (fadev.h), so an empty copy is a
 * device-wide barrier: work queued on other streams (another library's) is finished after it. */
static PyObject *py_cuda_synchronize(PyObject *self, PyObject *args) {
    return copy_call(NULL, NULL, 0, 2, "cuda_synchronize");
}

static PyObject *py_cuda_pointer_device(PyObject *self, PyObject *args) {
    void *ptr;
    if (!PyArg_ParseTuple(args, "O&", parse_ptr, &ptr)) return NULL;
    int device = -1;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_pointer_device(ptr, &device);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_device_status(st, "cuda_pointer_device");
    return PyLong_FromLong(device);
}

static PyObject *py_cuda_current_device(PyObject *self, PyObject *args) {
    int device = -1;
    fadev_status st = fadev_cuda_current_device(&device);
    if (st != FADEV_OK) return raise_device_status(st, "cuda_current_device");
    return PyLong_FromLong(device);
}

/* ------------------------------------------------------------ kernels: one table, one dispatcher */

typedef struct device_options {
    call_options c;
    fadev_native_params native;
} device_options;

typedef fadev_status (*device_fn)(void *const *p, const device_options *o);

typedef struct device_entry {
    const char *name; /* error prefix */
    int n_ptrs;       /* device pointers first, then the shape tuple and the call spec */
    int needs;        /* what of the call spec it reads (enum call_needs) */
    int native;       /* 1: then the native options (dtype, deterministic, warp_rows, mma) */
    device_fn run;
    int queued;       /* 1: a trailing stream argument (0, the legacy default stream) may make the call asynchronous */
    int late;         /* > 0: in a queued call one callable may stand for the last `late` pointers (late_fill) */
} device_entry;

static fadev_status run_baseline(void *const *p, const device_options *o) {
    return fadev_cuda_baseline_attention(p[0], p[1], p[2], p[3], p[4], &o->c.pr, &o->c.policy);
}

static fadev_status run_flash(void *const *p, const device_options *o) {
    return fadev_cuda_flash_attention(p[0], p[1], p[2], p[3], p[4], &o->c.pr, &o->c.policy);
}

static fadev_status run_golden(void *const *p, const device_options *o) {
    return fadev_cuda_golden_attention(p[0], p[1], p[2], p[3], p[4], &o->c.pr);
}

static fadev_status run_baseline_backward(void *const *p, const device_options *o) {
    return fadev_cuda_baseline_attention_backward(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], &o->c.pr,
                                                  &o->c.policy, &o->c.policy_backward);
}

static fadev_status run_flash_backward(void *const *p, const device_options *o) {
    return fadev_cuda_flash_attention_backward(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], &o->c.pr,
                                               &o->c.policy, &o->c.policy_backward);
}

static fadev_status run_native_forward(void *const *p, const device_options *o) {
    return fadev_cuda_native_forward(p[0], p[1], p[2], p[3], p[4], &o->native);
}

static fadev_status run_native_backward(void *const *p, const device_options *o) {
    return fadev_cuda_native_backward(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], &o->native);
}

#define POLICIES (NEEDS_POLICY | NEEDS_POLICY_BACKWARD)

static const device_entry baseline_entry = {"baseline_attention (cuda)", 5, NEEDS_POLICY, 0, run_baseline, 1, 2};
static const device_entry flash_entry = {"flash_attention (cuda)", 5, NEEDS_POLICY, 0, run_flash, 1, 2};
static const device_entry golden_entry = {"golden_attention (cuda)", 5, 0, 0, run_golden, 1, 0};
static const device_entry baseline_backward_entry = {"baseline_attention_backward (cuda)", 9, POLICIES, 0,
                                                     run_baseline_backward, 1, 0};
static const device_entry flash_backward_entry = {"flash_attention_backward (cuda)", 9, POLICIES, 0,
                                                  run_flash_backward, 1, 0};
static const device_entry native_forward_entry = {"native_attention (cuda)", 5, 0, 1, run_native_forward, 0, 0};
static const device_entry native_backward_entry = {"native_attention_backward (cuda)", 10, 0, 1, run_native_backward,
                                                   0, 0};

/* The shape, the call spec and (native) the native options at items first.. of args into o; 0 with an exception. */
static int parse_tail(const device_entry *e, PyObject *args, Py_ssize_t first, device_options *o) {
    if (!parse_call(PyTuple_GET_ITEM(args, first + 1), e->needs, &o->c, e->name)) return 0;
    if (!parse_shape(PyTuple_GET_ITEM(args, first), &o->c.pr)) return 0;
    o->native.attn = o->c.pr;
    return !e->native || parse_native(PyTuple_GET_ITEM(args, first + 2), &o->native);
}

/* The last calls' parsed tails, by the identity of their tuples: a replayed call (fadev.cuda_plans) passes the same
 * shape and call tuples every time, and parsing the call's policy (13 format tuples) was 3.6-8.6 us of the host's
 * time before its first kernel (H200 host, naive bf16 causal, benchmarks/README.md). An entry holds a reference to
 * each of its tuples, so that no other object can take one's address while it is kept, and keeps only exact tuples
 * (of ints, floats, None and tuples of those: the parse rejects anything else), which cannot change. The GIL guards
 * the table. */
#define KEPT_TAILS 8
typedef struct kept_tail {
    const device_entry *e;
    PyObject *items[3]; /* shape, call spec, native options (NULL past the entry's) */
    device_options o;
} kept_tail;
static kept_tail kept_tails[KEPT_TAILS];
static int kept_next;

static int parse_tail_kept(const device_entry *e, PyObject *args, Py_ssize_t first, device_options *o) {
    const int n = 2 + e->native;
    for (int i = 0; i < KEPT_TAILS; i++) {
        const kept_tail *t = &kept_tails[i];
        int same = t->e == e;
        for (int x = 0; same && x < n; x++) same = t->items[x] == PyTuple_GET_ITEM(args, first + x);
        if (same) return *o = t->o, 1;
    }
    if (!parse_tail(e, args, first, o)) return 0;
    for (int x = 0; x < n; x++)
        if (!PyTuple_CheckExact(PyTuple_GET_ITEM(args, first + x))) return 1;
    kept_tail *t = &kept_tails[kept_next];
    kept_next = (kept_next + 1) % KEPT_TAILS;
    for (int x = 0; x < 3; x++) Py_CLEAR(t->items[x]);
    t->e = e, t->o = *o;
    for (int x = 0; x < n; x++) {
        t->items[x] = PyTuple_GET_ITEM(args, first + x);
        Py_INCREF(t->items[x]);
    }
    return 1;
}

/* A queued forward's outputs from a callable (fadev_late_outputs): called once the call's first kernel is queued,
 * with the GIL taken back for it, alloc() must return (pointers, value): a tuple of the entry's `n` output pointers
 * and what the call returns. fadev.cuda_plans' replay passes one that allocates its result tensors, so that their
 * allocation runs while the GPU rounds the inputs. */
typedef struct late_call {
    const device_entry *e;
    PyObject *alloc;
    PyObject *value; /* alloc's value, once it gave valid pointers */
    int failed;      /* 1: alloc raised or returned something else; its exception is set */
} late_call;

static fadev_status late_fill(void *ctx, void **ptrs) {
    late_call *c = (late_call *)ctx;
    const PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *r = PyObject_CallNoArgs(c->alloc), *p = NULL;
    int ok = r != NULL;
    if (ok) {
        p = PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2 ? PyTuple_GET_ITEM(r, 0) : NULL;
        ok = p && PyTuple_Check(p) && PyTuple_GET_SIZE(p) == c->e->late;
        if (!ok)
            PyErr_Format(PyExc_TypeError, "%s: the outputs' callable must return (a tuple of %d device pointers, a "
                         "value), got %.100s", c->e->name, c->e->late, Py_TYPE(r)->tp_name);
    }
    for (int x = 0; ok && x < c->e->late; x++) ok = parse_ptr(PyTuple_GET_ITEM(p, x), &ptrs[x]);
    if (ok) {
        c->value = PyTuple_GET_ITEM(r, 1);
        Py_INCREF(c->value);
    }
    Py_XDECREF(r);
    c->failed = !ok;
    PyGILState_Release(gil);
    return ok ? FADEV_OK : FADEV_ERR_INVALID_ARGUMENT;
}

/* The one dispatcher: args are the entry's pointers, shape, call spec (and native options); the kernel runs without
 * the GIL. A queued entry with `late` outputs may take, in place of those pointers, one callable (late_call) and then
 * the stream argument: the call returns the callable's value. */
static PyObject *device_call(const device_entry *e, PyObject *args) {
    void *p[10] = {NULL};
    device_options o;
    memset(&o, 0, sizeof o);
    const Py_ssize_t given = PyTuple_GET_SIZE(args), n_in = e->n_ptrs - e->late;
    const int late = e->late && given > n_in && PyCallable_Check(PyTuple_GET_ITEM(args, n_in));
    const Py_ssize_t n_ptrs = late ? n_in + 1 : e->n_ptrs, n_args = n_ptrs + 2 + e->native;
    if (late && given != n_args + 1)
        return PyErr_Format(PyExc_TypeError, "%s: expected %zd arguments (%zd device pointers, the outputs' callable, "
                            "shape, call, stream), got %zd", e->name, n_args + 1, n_in, given);
    if (!late && given != n_args && !(e->queued && given == n_args + 1))
        return PyErr_Format(PyExc_TypeError, "%s: expected %zd arguments (%d device pointers, shape, call%s%s), got %zd",
                            e->name, n_args, e->n_ptrs, e->native ? ", native options" : "",
                            e->queued ? "[, stream]" : "", given);
    for (Py_ssize_t x = 0; x < n_ptrs - late; x++)
        if (!parse_ptr(PyTuple_GET_ITEM(args, x), &p[x])) return NULL;
    if (!parse_tail_kept(e, args, n_ptrs, &o)) return NULL;
    if (given == n_args + 1) {
        const unsigned long long stream = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args, n_args));
        if (PyErr_Occurred()) return NULL;
        if (stream != 0)
            return PyErr_Format(PyExc_ValueError, "%s: stream must be 0 (the legacy default stream: the emulated "
                                "and golden kernels queue there only), got %llu", e->name, stream);
        o.c.pr.asynchronous = 1;
    }
    late_call lc = {e, late ? PyTuple_GET_ITEM(args, n_in) : NULL, NULL, 0};
    const fadev_late_outputs outputs = {late_fill, &lc};
    if (late) o.c.pr.late = &outputs;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = e->run(p, &o);
    Py_END_ALLOW_THREADS
    if (lc.failed) return NULL;
    if (st != FADEV_OK) {
        Py_XDECREF(lc.value);
        return raise_device_status(st, e->name);
    }
    if (late) return lc.value;
    Py_RETURN_NONE;
}

#define DEVICE_METHOD(kernel) \
    static PyObject *py_cuda_##kernel(PyObject *self, PyObject *args) { return device_call(&kernel##_entry, args); }
DEVICE_METHOD(baseline)
DEVICE_METHOD(flash)
DEVICE_METHOD(golden)
DEVICE_METHOD(baseline_backward)
DEVICE_METHOD(flash_backward)
DEVICE_METHOD(native_forward)
DEVICE_METHOD(native_backward)

#define MAX_NATIVE_TILES 64

static PyObject *py_cuda_native_tiles(PyObject *self, PyObject *args) {
    int dim, backward, warp_rows, mma, count = 0;
    int32_t tiles[2 * MAX_NATIVE_TILES];
    if (!PyArg_ParseTuple(args, "ipii", &dim, &backward, &warp_rows, &mma)) return NULL;
    fadev_status st = fadev_cuda_native_tiles(dim, backward, warp_rows, mma, tiles, MAX_NATIVE_TILES, &count);
    if (st != FADEV_OK) return raise_device_status(st, "native_tiles (cuda)");
    if (count > MAX_NATIVE_TILES) count = MAX_NATIVE_TILES;
    PyObject *list = PyList_New(0);
    for (int i = 0; list && i < count; i++) {
        PyObject *pair = Py_BuildValue("(ii)", (int)tiles[2 * i], (int)tiles[2 * i + 1]);
        if (!pair || PyList_Append(list, pair) < 0) Py_CLEAR(list);
        Py_XDECREF(pair);
    }
    return list;
}

/* cuda_native_workspace(shape, call, native) */
static PyObject *py_cuda_native_workspace(PyObject *self, PyObject *args) {
    device_options o;
    memset(&o, 0, sizeof o);
    if (PyTuple_GET_SIZE(args) != 3)
        return PyErr_Format(PyExc_TypeError, "native_workspace (cuda): expected (shape, call, native options)");
    if (!parse_tail(&native_backward_entry, args, 0, &o)) return NULL;
    return PyLong_FromSize_t(fadev_cuda_native_workspace(&o.native));
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
    if (st != FADEV_OK) return raise_device_status(st, "deviation (cuda)");
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
    if (st != FADEV_OK) return raise_device_status(st, "wasserstein (cuda)");
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
    if (st != FADEV_OK) return raise_device_status(st, "ulp_error (cuda)");
    Py_RETURN_NONE;
}

static PyObject *py_cuda_exp_check(PyObject *self, PyObject *args) {
    int exp2_form, ref_form = -1;
    unsigned long long start, count;
    if (!PyArg_ParseTuple(args, "pKK|p", &exp2_form, &start, &count, &ref_form)) return NULL;
    if (ref_form < 0) ref_form = exp2_form;
    if (start > (1ull << 32) || count > (1ull << 32) - start)
        return PyErr_Format(PyExc_ValueError, "start + count must be <= 2**32, got start %llu, count %llu", start, count);
    uint64_t bad = 0;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_exp_check(exp2_form, ref_form, start, count, &bad);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_device_status(st, "exp_check (cuda)");
    return PyLong_FromUnsignedLongLong(bad);
}

/* The checks' fmt argument (args' first): 'bf16' or 'fp16', else 0 with a ValueError naming it. */
static int fmt16_ok(const char *fmt, PyObject *args) {
    if (strcmp(fmt, "bf16") == 0 || strcmp(fmt, "fp16") == 0) return 1;
    PyErr_Format(PyExc_ValueError, "fmt must be 'bf16' or 'fp16', got %R", PyTuple_GET_ITEM(args, 0));
    return 0;
}

static PyObject *py_cuda_exp_table_check(PyObject *self, PyObject *args) {
    const char *fmt;
    int exp2_form, ref_form = -1;
    if (!PyArg_ParseTuple(args, "sp|p", &fmt, &exp2_form, &ref_form)) return NULL;
    if (!fmt16_ok(fmt, args)) return NULL;
    if (ref_form < 0) ref_form = exp2_form;
    uint64_t bad = 0;
    int lo = 0, hi = 0;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_exp_table_check(fmt[0] == 'b', exp2_form, ref_form, &bad, &lo, &hi);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_device_status(st, "exp_table_check (cuda)");
    return Py_BuildValue("Kii", (unsigned long long)bad, lo, hi);
}

static PyObject *py_cuda_quot_check(PyObject *self, PyObject *args) {
    const char *fmt;
    int naive = 0;
    if (!PyArg_ParseTuple(args, "s|p", &fmt, &naive)) return NULL;
    if (!fmt16_ok(fmt, args)) return NULL;
    uint64_t bad = 0, pairs = 0;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_quot_check(fmt[0] == 'b', naive, &bad, &pairs);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_device_status(st, "quot_check (cuda)");
    return Py_BuildValue("KK", (unsigned long long)bad, (unsigned long long)pairs);
}

static PyObject *py_cuda_round_check(PyObject *self, PyObject *args) {
    const char *fmt;
    int naive = 0;
    if (!PyArg_ParseTuple(args, "s|p", &fmt, &naive)) return NULL;
    if (!fmt16_ok(fmt, args)) return NULL;
    uint64_t bad = 0;
    fadev_status st;
    Py_BEGIN_ALLOW_THREADS
    st = fadev_cuda_round_check(fmt[0] == 'b', naive, &bad);
    Py_END_ALLOW_THREADS
    if (st != FADEV_OK) return raise_device_status(st, "round_check (cuda)");
    return PyLong_FromUnsignedLongLong(bad);
}

/* ------------------------------------------------------------ method table */

PyMethodDef cuda_methods[] = {
    {"cuda_malloc", py_cuda_malloc, METH_VARARGS, "cuda_malloc(bytes) -> device pointer (int)"},
    {"cuda_free", py_cuda_free, METH_VARARGS, "cuda_free(ptr)"},
    {"cuda_upload", py_cuda_upload, METH_VARARGS, "cuda_upload(dst_ptr, host_buffer): copy the whole buffer"},
    {"cuda_download", py_cuda_download, METH_VARARGS, "cuda_download(host_buffer, src_ptr): fill the whole buffer"},
    {"cuda_copy", py_cuda_copy, METH_VARARGS, "cuda_copy(dst_ptr, src_ptr, bytes): device to device"},
    {"cuda_synchronize", py_cuda_synchronize, METH_NOARGS, "cuda_synchronize(): wait for all work on the device"},
    {"cuda_current_device", py_cuda_current_device, METH_NOARGS, "cuda_current_device() -> this thread's device"},
    {"cuda_pointer_device", py_cuda_pointer_device, METH_VARARGS,
     "cuda_pointer_device(ptr) -> device index owning ptr, -1 for host memory"},
    {"cuda_baseline_attention", py_cuda_baseline, METH_VARARGS,
     "cuda_baseline_attention(q, k, v, out, lse, shape, call[, stream]); shape (B, H, Hkv, Nq, Nk, D), call "
     "fadev._args.Call.c, stream 0: queued on the legacy default stream, no synchronisation"},
    {"cuda_flash_attention", py_cuda_flash, METH_VARARGS, "cuda_flash_attention(q, k, v, out, lse, shape, call[, stream])"},
    {"cuda_golden_attention", py_cuda_golden, METH_VARARGS,
     "cuda_golden_attention(q, k, v, out, lse, shape, call); the call's policy not read"},
    {"cuda_baseline_attention_backward", py_cuda_baseline_backward, METH_VARARGS,
     "cuda_baseline_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, shape, call[, stream])"},
    {"cuda_flash_attention_backward", py_cuda_flash_backward, METH_VARARGS,
     "cuda_flash_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, shape, call[, stream])"},
    {"cuda_deviation", py_cuda_deviation, METH_VARARGS, "cuda_deviation(test, ref, n) -> dict of metrics"},
    {"cuda_wasserstein", py_cuda_wasserstein, METH_VARARGS, "cuda_wasserstein(a, n_a, b, n_b) -> w1"},
    {"cuda_ulp_error", py_cuda_ulp_error, METH_VARARGS, "cuda_ulp_error(test, ref, n, fmt, out)"},
    {"cuda_exp_check", py_cuda_exp_check, METH_VARARGS,
     "cuda_exp_check(exp2, start, count[, ref_exp2]) -> how many fp32 inputs (encodings start .. start + count - 1) "
     "the emulated kernels' exp (exp2 False) or exp2 transcription gives other fp64 bits than CUDA's exp or exp2 "
     "(ref_exp2, default exp2)"},
    {"cuda_quot_check", py_cuda_quot_check, METH_VARARGS,
     "cuda_quot_check(fmt[, naive]) -> (mismatches, pairs): the emulated baseline's P = R_p(e / l) from l's reciprocal "
     "against the division, fmt 'bf16' or 'fp16'; naive: the reciprocal's product without the bounds' test"},
    {"cuda_round_check", py_cuda_round_check, METH_VARARGS,
     "cuda_round_check(fmt[, naive]) -> mismatches: the emulated kernels' rounding of fp32 values to fmt ('bf16' or "
     "'fp16': the hardware's conversions) against the rule on the encoding, every fp32 input; naive: truncation"},
    {"cuda_exp_table_check", py_cuda_exp_table_check, METH_VARARGS,
     "cuda_exp_table_check(fmt, exp2[, ref_exp2]) -> (mismatches, lo, hi): the emulated forward's table of softmax "
     "terms for fmt 'bf16' or 'fp16' against the computation (exp2 form ref_exp2, default exp2) for every 16-bit value "
     "<= 0, and the table's clamp bounds (magnitude bits)"},
    {"cuda_native_tiles", py_cuda_native_tiles, METH_VARARGS,
     "cuda_native_tiles(dim, backward, warp_rows, mma) -> [(block_q, block_kv), ...] of the forward (backward False; "
     "warp_rows 16 or 32) or the backward (warp_rows 16 or 32); mma 1: the wgmma kernels' tiles"},
    {"cuda_native_workspace", py_cuda_native_workspace, METH_VARARGS,
     "cuda_native_workspace(shape, call, native) -> bytes of float32 workspace the backward needs"},
    {"cuda_native_forward", py_cuda_native_forward, METH_VARARGS,
     "cuda_native_forward(q, k, v, out, lse, shape, call, native); native (dtype, deterministic, warp_rows, mma"
     "[, stream[, strides]]); strides: (batch, head, row) element strides of q, k, v, out (12 ints)"},
    {"cuda_native_backward", py_cuda_native_backward, METH_VARARGS,
     "cuda_native_backward(q, k, v, out, lse, dout, dq, dk, dv, workspace, shape, call, native); strides: of q, k, v, "
     "out, dout, dq, dk, dv (24 ints)"},
    {NULL, NULL, 0, NULL},
};
