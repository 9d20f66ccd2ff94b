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
 * fadev_policy_backward, RingMerge._c -> fadev_ring_params, a device address (int) -> void *, a device call's
 * shape tuple -> fadev_attention_params' shapes, the native options -> fadev_native_params' own fields. */
FADEV_HIDDEN int parse_format(PyObject *obj, void *out);
FADEV_HIDDEN int parse_policy(PyObject *obj, void *out);
FADEV_HIDDEN int parse_policy_backward(PyObject *obj, void *out);
FADEV_HIDDEN int parse_ring(PyObject *obj, void *out);
FADEV_HIDDEN int parse_ptr(PyObject *obj, void *out);
FADEV_HIDDEN int parse_shape(PyObject *obj, void *out);
FADEV_HIDDEN int parse_native(PyObject *obj, void *out);

/* New reference to a C-contiguous, aligned, native-order array of `type` (copying if needed); NULL with
 * TypeError naming `name`. */
FADEV_HIDDEN PyObject *as_array(PyObject *obj, int type, const char *name);
/* A new array of `type` shaped like `shape_of` (its first `ndim` dimensions; -1: all). */
FADEV_HIDDEN PyObject *new_like(PyObject *shape_of, int ndim, int type);

/* Everything a kernel reads besides its arrays. */
typedef struct call_options {
    fadev_attention_params pr;
    fadev_policy policy;
    fadev_policy_backward policy_backward;
    fadev_ring_params ring;
} call_options;

/* What of the call spec a kernel reads besides scale, causal and the tiling (the rest may be None). */
enum call_needs { NEEDS_POLICY = 1, NEEDS_POLICY_BACKWARD = 2, NEEDS_RING = 4 };

/* The one call spec of every attention entry point, host (module.c) or device (module_cuda.c): the tuple
 * fadev/_args.py's Call.c builds, (policy, policy_backward, ring, scale, causal, block_q, block_kv, loop_order,
 * normalize, exp_form), policy / policy_backward / ring None where the kernel reads none (`needs` says which it
 * reads: TypeError naming `what` when one of them is None). Fills c; shapes left 0 for the caller. 0 with an
 * exception. */
FADEV_HIDDEN int parse_call(PyObject *obj, int needs, call_options *c, const char *what);

/* A fadev_deviation as the dict fadev.metrics reads. */
FADEV_HIDDEN PyObject *deviation_dict(const fadev_deviation *dev);

/* module_cuda.c's methods, added to fadev._core by PyInit__core. */
extern FADEV_HIDDEN PyMethodDef cuda_methods[];
/* module_fast.c: the CPU fast paths' private methods (tests, benchmarks). */
extern FADEV_HIDDEN PyMethodDef fast_methods[];

#endif /* FADEV_MODULE_H */
