/* What the two halves of fadev._core's binding share: module.c (host arrays, the module itself) and
 * module_cuda.c (device pointers). One status-to-exception rule and one parser per struct, used by both.
 * Hidden: internal to the extension, not exported from it. */
#ifndef FADEV_MODULE_H
#define FADEV_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fadev.h"

#define FADEV_HIDDEN __attribute__((visibility("hidden")))

/* Sets the exception for a non-OK status (ValueError, MemoryError -- CUDA's out of memory too --, or
 * RuntimeError) with `what` and the status in the message; returns NULL. */
FADEV_HIDDEN PyObject *raise_status(fadev_status st, const char *what);
/* PyArg "O&" converters: Format._c -> fadev_format, Policy._c -> fadev_policy,
 * Policy._c_backward -> fadev_policy_backward. */
FADEV_HIDDEN int parse_format(PyObject *obj, void *out);
FADEV_HIDDEN int parse_policy(PyObject *obj, void *out);
FADEV_HIDDEN int parse_policy_backward(PyObject *obj, void *out);
/* A fadev_deviation as the dict fadev.metrics reads. */
FADEV_HIDDEN PyObject *deviation_dict(const fadev_deviation *dev);

/* module_cuda.c's methods, added to fadev._core by PyInit__core. */
extern FADEV_HIDDEN PyMethodDef cuda_methods[];

#endif /* FADEV_MODULE_H */
