/* What the parts of fadev._core's one binding share: module_args.c (converters, arrays, errors, the
 * option lists of the attention entry points), module.c (host arrays, the module itself) and module_cuda.c
 * (device pointers). Hidden: internal to the extension, not exported from it. */
#ifndef FADEV_MODULE_H
#define FADEV_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fadev.h"

#define FADEV_HIDDEN __attribute__((visibility("hidden")))

/* Sets the exception for a non-OK status (ValueError, MemoryError or RuntimeError) with `what` and the
 * status in the message; returns NULL. raise_status adds CUDA's message to FADEV_ERR_CUDA and
 * FADEV_ERR_NO_CUDA; raise_device_status (entry points running on the device) to FADEV_ERR_NO_MEMORY too. */
FADEV_HIDDEN PyObject *raise_status(fadev_status st, const char *what);
FADEV_HIDDEN PyObject *raise_device_status(fadev_status st, const char *what);

/* PyArg "O&" converters: Format._c -> fadev_format, Policy._c -> fadev_policy, Policy._c_backward ->
 * fadev_policy_backward, RingMerge._c -> fadev_ring_params, a device address (int) -> void *, the CUDA
 * params tuples -> fadev_attention_params, fadev_native_params. */
FADEV_HIDDEN int parse_format(PyObject *obj, void *out);
FADEV_HIDDEN int parse_policy(PyObject *obj, void *out);
FADEV_HIDDEN int parse_policy_backward(PyObject *obj, void *out);
FADEV_HIDDEN int parse_ring(PyObject *obj, void *out);
FADEV_HIDDEN int parse_ptr(PyObject *obj, void *out);
FADEV_HIDDEN int parse_params(PyObject *obj, void *out);
FADEV_HIDDEN int parse_native_params(PyObject *obj, void *out);

/* New reference to a C-contiguous, aligned, native-order array of `type` (copying if needed); NULL with
 * TypeError naming `name`. */
FADEV_HIDDEN PyObject *as_array(PyObject *obj, int type, const char *name);
/* A new array of `type` shaped like `shape_of` (its first `ndim` dimensions; -1: all). */
FADEV_HIDDEN PyObject *new_like(PyObject *shape_of, int ndim, int type);

/* The options of an attention entry point after its arrays, in this order where present. */
enum call_option {
    OPT_END = 0, OPT_POLICY, OPT_POLICY_BACKWARD, OPT_RING, OPT_SCALE, OPT_CAUSAL, OPT_BLOCK_Q, OPT_BLOCK_KV,
    OPT_LOOP_ORDER, OPT_NORMALIZE, OPT_EXP_FORM
};

/* Everything a kernel reads besides its arrays. */
typedef struct call_options {
    fadev_attention_params pr;
    fadev_policy policy;
    fadev_policy_backward policy_backward;
    fadev_ring_params ring;
} call_options;

/* Fills c from items first.. of args as `options` (OPT_END-terminated) lists them; 0 with an exception
 * (TypeError for a wrong count, naming `what`). Shapes are left 0 for the caller. */
FADEV_HIDDEN int parse_options(PyObject *args, Py_ssize_t first, const unsigned char *options, call_options *c,
                               const char *what);

/* A fadev_deviation as the dict fadev.metrics reads. */
FADEV_HIDDEN PyObject *deviation_dict(const fadev_deviation *dev);

/* module_cuda.c's methods, added to fadev._core by PyInit__core. */
extern FADEV_HIDDEN PyMethodDef cuda_methods[];

#endif /* FADEV_MODULE_H */
