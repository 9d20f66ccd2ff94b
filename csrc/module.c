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

/* CPython passes (self, args) to every method; most of ours use neither self nor, for METH_NOARGS, args. */
#pragma GCC diagnostic ignored "-Wunused-parameter"

/* ------------------------------------------------------------ helpers */

static PyObject *raise_status(fadev_status st, const char *what) {
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
    if (st == FADEV_ERR_CUDA)
        PyErr_Format(kind, "%s: %s (%s)", what, fadev_status_string(st), fadev_cuda_last_error());
    else
        PyErr_Format(kind, "%s: %s", what, fadev_status_string(st));
    return NULL;
}

/* A format arrives as the tuple (precision, emin, emax, subnormals, has_inf, overflow, largest). */
static int parse_format(PyObject *obj, void *out) {
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

/* ------------------------------------------------------------ attention */

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
    /* attention methods */
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {PyModuleDef_HEAD_INIT, "fadev._core", "fadev's C core (see csrc/fadev.h).",
                                         -1, core_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__core(void) {
    import_array();
    return PyModule_Create(&core_module);
}
