"""Repeated emulated calls on the GPU: an argument set's checks made once, then replayed.

A training loop or a sweep calls :func:`fadev.flash_attention` (and the baseline, the golden forward and the two
backwards) again and again with the same policy, options and shapes, on PyTorch CUDA float64 tensors. The full path
(route the call, read each tensor, check the shapes and the policy, build the Call and its C tuples, reshape the
results) costs ~100 us of host time a call, during which a GPU that finished the previous call waits (issue 24:
0.3 ms of idle GPU a call at N 4096). So the first call of an argument set that ran queued on PyTorch's stream
(fadev.cuda's module docstring: PyTorch tensors while PyTorch's current stream is the legacy default stream) leaves
a plan: the binding's entry, its shape and call tuples, the results' shapes. A later call replays it -- allocates the
results and calls the binding (an emulated forward's binding allocates them itself, by a callable, once it has queued
the inputs' rounding: the GPU works while the host allocates) -- when every argument is the same: the policy the same object (or the same preset
string), every other option of the same type and value, every tensor a contiguous float64 CUDA tensor (no negative
view) of the same shape on the current CUDA device, and PyTorch's current stream still the legacy default stream.
Anything else takes the full path, which raises the errors; a replay gives the full path's results bit for bit (the
same binding call on the same pointers).
"""
from __future__ import annotations

import sys
from functools import partial
from typing import NamedTuple

from . import _core
from .cuda import _shape, torch_stream
from .policy import Policy

_LIMIT = 256  # plans kept; the oldest goes first, so a sweep over many shapes does not grow without bound
_PLAIN = frozenset((type(None), bool, int, float, str))


class _Plan(NamedTuple):
    policy: object  # the call's policy argument (a Policy object the key names by id: kept alive, identity checked)
    entry: object   # the binding's function
    shape: tuple    # its (batch, heads, heads_kv, seq_q, seq_kv, dim)
    c: tuple        # the Call's C tuple
    results: tuple  # the shapes of the binding's results, in the caller's rank
    first: bool     # return the first result alone (a forward without its lse)
    late: bool      # the binding allocates the results by a callable once its first kernel is queued (the emulated
                    # forwards: their allocation then runs while the GPU rounds the inputs, not before it has work)


_PLANS: dict = {}


def _eligible(tensors, torch):
    """The CUDA device index of the tensors when every one is a contiguous float64 CUDA tensor read in place, on one
    device; else None."""
    dev = None
    for t in tensors:
        if not (isinstance(t, torch.Tensor) and t.is_cuda and t.dtype is torch.float64 and t.is_contiguous()
                and not t.is_neg()):
            return None
        d = t.get_device()
        if dev is None:
            dev = d
        elif d != dev:
            return None
    return dev


def replay(entry, device, policy, options, tensors):
    """(key, results): the results of the call's plan where one applies, else (the key to :func:`keep` the call's
    plan under, or None where it cannot have one; None). ``entry``: the binding's function name; ``options``: the
    call's other arguments (plain values)."""
    torch = sys.modules.get("torch")
    if device is not None or torch is None:
        return None, None
    named = type(policy) is Policy  # a Policy object: keyed by identity (hashing one takes ~9 us)
    if not (named or policy is None or type(policy) is str):
        return None, None
    if not all(type(o) in _PLAIN for o in options):
        return None, None
    dev = _eligible(tensors, torch)
    if dev is None:
        return None, None
    key = (entry, id(policy) if named else policy, options, tuple(map(type, options)), tuple(t.shape for t in tensors),
           dev)
    plan = _PLANS.get(key)
    if plan is None or (named and plan.policy is not policy) or not _queued(dev):
        return key, None
    ptrs = tuple(t.data_ptr() for t in tensors)
    if plan.late:  # the binding asks for the results once the inputs' rounding is queued
        results = plan.entry(*ptrs, partial(_results, tensors[0].new_empty, plan.results), plan.shape, plan.c, 0)
    else:
        results = _results(tensors[0].new_empty, plan.results)[1]
        plan.entry(*ptrs, *(r.data_ptr() for r in results), plan.shape, plan.c, 0)
    return key, (results[0] if plan.first else results)


def _results(new_empty, shapes):
    """(their device pointers, the result tensors) of new tensors of ``shapes`` (float64 on q's device: new_empty,
    ~1.5 us less than torch.empty)."""
    results = tuple(new_empty(s) for s in shapes)
    return tuple(r.data_ptr() for r in results), results


def _queued(dev) -> bool:
    return _core.cuda_current_device() == dev and torch_stream(dev) == 0


def keep(key, gpu, policy, call, q4, k4, result):
    """``result`` (returned as it is), after keeping the plan of a call that :func:`replay` gave ``key`` and that
    ran queued on PyTorch's stream (``gpu``: its fadev.cuda._Gpu; ``call``, ``q4``, ``k4``: its Call and 4-D
    operands)."""
    if key is None or gpu is None or not gpu._queued:
        return result
    first = not isinstance(result, tuple)
    results = tuple(r.shape for r in ((result,) if first else result))
    if key[0].endswith("_attention") and first:  # a forward without its lse: the binding writes one anyway
        results += (tuple(result.shape[:-1]),)
    if len(_PLANS) >= _LIMIT:
        _PLANS.pop(next(iter(_PLANS)))
    late = key[0] in ("cuda_baseline_attention", "cuda_flash_attention")
    _PLANS[key] = _Plan(policy, getattr(_core, key[0]), _shape(q4, k4), call.c, results, first, late)
    return result


def clear() -> None:
    """Forget every plan (tests; a plan holds its Policy alive)."""
    _PLANS.clear()
