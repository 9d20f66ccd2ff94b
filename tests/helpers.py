"""Helpers shared by the test files: bit comparisons, seeded inputs, plain float64 attention references.

Bit comparisons take an explicit NaN rule, because the tests need two:
  nan="exact"  every float64 bit equal, NaN payload and sign included (results of one code path,
               or of two paths promised to be the same: thread counts, APIs, the torch bridge);
  nan="any"    any NaN equals any NaN, every other value bit for bit (signed zeros distinguished): the C
               kernels against their Python twin or against the GPU, whose NaN payloads are not specified
               (docs/numerics.md, "GPU").
Arrays are compared as float64 (np.asarray(x, float64): exact for every narrower float type).

The references (numpy_attention, numpy_grads, torch_grads) are independent of fadev and of
docs/numerics.md's operation order: plain float64 softmax(scale Q K^T) V with K/V heads repeated for
grouped-query and the bottom-right causal mask; a row that sees no key gives out 0 and lse -inf.
"""
from __future__ import annotations

import ctypes
import math
import time

import numpy as np
import pytest

import fadev

NAN_RULES = ("exact", "any")

needs_gpu = pytest.mark.skipif(not fadev.cuda_available(), reason="no CUDA device (fadev.cuda_available() is False)")


# ---------------------------------------------------------------- bit comparisons


def _float64(a, b):
    return np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)


def bits_differ(a, b, *, nan):
    """Boolean array: where a and b differ in bits under the NaN rule ``nan`` ("exact" or "any")."""
    if nan not in NAN_RULES:
        raise ValueError(f"nan must be one of {NAN_RULES}, got {nan!r}")
    a, b = _float64(a, b)
    assert a.shape == b.shape, (a.shape, b.shape)
    differ = a.view(np.uint64) != b.view(np.uint64)
    if nan == "any":
        differ &= ~(np.isnan(a) & np.isnan(b))
    return differ


def same_bits(a, b, *, nan) -> bool:
    """True when a and b have one shape and the same bits under the NaN rule ``nan``."""
    a, b = _float64(a, b)
    return a.shape == b.shape and not bits_differ(a, b, nan=nan).any()


def identical(a, b) -> bool:
    """Results of one code path, or of paths promised to be the same: every bit, NaN payloads included."""
    return same_bits(a, b, nan="exact")


def identical_but_nan(a, b) -> bool:
    """The GPU (or a Python twin) against the CPU: every bit, but any NaN equals any NaN."""
    return same_bits(a, b, nan="any")


def count_differing(a, b, *, nan) -> int:
    """How many elements of a and b differ in bits under the NaN rule ``nan`` (shapes must match)."""
    return int(bits_differ(a, b, nan=nan).sum())


def first_difference(a, b, *, nan):
    """Index of the first element where a and b differ in bits under ``nan``, or None."""
    differ = bits_differ(a, b, nan=nan)
    return tuple(int(i) for i in np.argwhere(differ)[0]) if differ.any() else None


def assert_same_bits(got, want, what, context, *, nan, names=("C", "twin")):
    """Fails with the first differing element (both values in hex), the count and ``context``."""
    got, want = _float64(got, want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}\n  {context}"
    differ = bits_differ(got, want, nan=nan)
    if differ.any():
        at = tuple(int(i) for i in np.argwhere(differ)[0])
        pytest.fail(f"{what} differs from the {names[1]} at {at}: {names[0]} {float(got[at]).hex()} {names[1]} "
                    f"{float(want[at]).hex()} ({int(differ.sum())} of {differ.size} elements differ)\n  {context}")


def rel_err(a, b) -> float:
    """Normwise relative error max|a - b| / max|b|."""
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ---------------------------------------------------------------- seeded inputs


def make_qkv(seed, B, H, Hkv, Nq, Nk, D, spread=1.0, k_spread=1.0):
    """Standard normal q (B, H, Nq, D), k, v (B, Hkv, Nk, D) drawn in that order; q times ``spread``
    (> 1 widens the scores: deep softmax tails, underflow), k times ``k_spread`` (1e-20 on both makes the
    q.k products fall below fp32's normals)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Nq, D)) * spread
    k = rng.standard_normal((B, Hkv, Nk, D)) * k_spread
    v = rng.standard_normal((B, Hkv, Nk, D))
    return q, k, v


def make_inputs(seed, B, H, Hkv, Nq, Nk, D, spread=1.0, magnitude=1.0):
    """q, k, v and dout for a backward test, drawn in that order: standard normal q (times ``spread``:
    > 1 sharpens the softmax), k, v and dout (times ``magnitude``: 1e-20 puts the dO.V and dS.Q products
    below fp32's normal range)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Nq, D)) * spread
    k = rng.standard_normal((B, Hkv, Nk, D)) * magnitude
    v = rng.standard_normal((B, Hkv, Nk, D)) * magnitude
    return q, k, v, rng.standard_normal((B, H, Nq, D)) * magnitude


# ---------------------------------------------------------------- float64 references


def causal_mask(nq, nk, causal):
    """visible[i, j]: query i sees key j (bottom-right aligned, j <= i + nk - nq; all True when not causal)."""
    if not causal:
        return np.ones((nq, nk), dtype=bool)
    return np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)


def numpy_attention(q, k, v, causal=False, scale=None):
    """(out, lse) of softmax(scale Q K^T) V in float64 with np.exp and BLAS matmuls; 4-D q (B, H, Nq, D),
    k and v (B, Hkv, Nk, D)."""
    H, Hkv, Nq, Nk, D = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    k, v = np.repeat(k, H // Hkv, axis=1), np.repeat(v, H // Hkv, axis=1)
    s = q @ np.swapaxes(k, -1, -2) * (1 / math.sqrt(D) if scale is None else scale)
    s = np.where(causal_mask(Nq, Nk, causal), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    empty = np.isneginf(m)  # a row that sees no key: out 0, lse -inf
    e = np.exp(s - np.where(empty, 0.0, m))
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return (e / np.where(empty, 1.0, l)) @ v, (m + np.log(l))[..., 0]


def numpy_grads(q, k, v, dout, causal=False, scale=None):
    """dq, dk, dv derived by hand in NumPy float64: P = softmax(S), O = P V, dV = P^T dO, dP = dO V^T,
    D = rowsum(dO * O), dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q; K/V heads of a group summed."""
    B, H, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    g = H // Hkv
    scale = 1 / math.sqrt(D) if scale is None else scale
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.where(causal_mask(Nq, Nk, causal), q @ np.swapaxes(kr, -1, -2) * scale, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isneginf(m), 0.0, m))
    l = np.sum(e, axis=-1, keepdims=True)
    P = e / np.where(l == 0, 1.0, l)
    O = P @ vr
    dP = dout @ np.swapaxes(vr, -1, -2)
    dS = P * (dP - np.sum(dout * O, axis=-1, keepdims=True))
    dq = scale * dS @ kr
    dk = scale * np.swapaxes(dS, -1, -2) @ q
    dv = np.swapaxes(P, -1, -2) @ dout
    return dq, dk.reshape(B, Hkv, g, Nk, D).sum(axis=2), dv.reshape(B, Hkv, g, Nk, D).sum(axis=2)


def torch_grads(q, k, v, dout, causal=False, scale=None):
    """dq, dk, dv by torch float64 autograd of the same attention (NumPy in, NumPy out). A row that sees no
    key gives out 0: its softmax runs on zeros and is multiplied by 0."""
    import torch  # only the tests that ask for torch's gradients need torch installed

    H, Hkv, Nq, Nk, D = q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3]
    tq, tk, tv = (torch.tensor(t, dtype=torch.float64, requires_grad=True) for t in (q, k, v))
    kk, vv = tk.repeat_interleave(H // Hkv, dim=1), tv.repeat_interleave(H // Hkv, dim=1)
    s = tq @ kk.transpose(-1, -2) * (1 / math.sqrt(D) if scale is None else scale)
    visible = torch.tensor(causal_mask(Nq, Nk, causal))
    empty = ~visible.any(dim=-1, keepdim=True)
    s = s.masked_fill(~visible, -math.inf).masked_fill(empty, 0.0)
    out = (torch.softmax(s, dim=-1) * ~empty) @ vv
    out.backward(torch.tensor(dout, dtype=torch.float64))
    return tuple(t.grad.numpy() for t in (tq, tk, tv))


# ---------------------------------------------------------------- the C API's structs (fadev.h), for ctypes calls


class Format(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int32) for n in ("precision", "emin", "emax", "subnormals", "has_inf", "overflow")] + \
        [("largest", ctypes.c_double)]


class CPolicy(ctypes.Structure):
    _fields_ = [(f"f{i}", Format) for i in range(13)] + [("rounding", ctypes.c_int32), ("seed", ctypes.c_uint64)]


class CPolicyBackward(ctypes.Structure):
    _fields_ = [(f"f{i}", Format) for i in range(11)] + [("ds_scaled", ctypes.c_int32)]


class Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("batch", "heads", "heads_kv", "seq_q", "seq_kv", "dim")] + \
        [("scale", ctypes.c_double)] + \
        [(n, ctypes.c_int32) for n in ("causal", "block_q", "block_kv", "loop_order", "normalize", "exp_form")]


# ---------------------------------------------------------------- sweep executors (module-level: Ray and Dask
# workers import them by name from this file)

SLOW_S = 0.25


def slow_evaluate(point):
    """fadev.sweep.evaluate after a sleep of SLOW_S (its numbers untouched): a sweep still running when the
    test kills its driver or a node."""
    time.sleep(SLOW_S)
    return fadev.sweep.evaluate(point)


def evaluate_failing_seed_1(point):
    """fadev.sweep.evaluate, except that a point of seed 1 raises, on whichever worker runs it."""
    if point["seed"] == 1:
        raise ValueError("seed 1 fails (on purpose)")
    return fadev.sweep.evaluate(point)


def kill_when(child, path, lines, timeout=120):
    """SIGKILL the child process once ``path`` holds at least ``lines`` complete lines; fails if the child
    ends first. Returns the number of complete lines then (the child's last write may be cut)."""
    import os
    import signal
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and child.poll() is None:
            if os.path.exists(path) and open(path, "rb").read().count(b"\n") >= lines:
                break
            time.sleep(0.001)
        assert child.poll() is None, "the child finished (or failed) before it could be killed"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL


def find_cycle(graph):
    """One cycle of a directed graph {node: [nodes it points to]} as a list (first == last), or None:
    depth-first search with colours; a node that points to itself is a cycle. test_build.py walks the
    C/CUDA #include graph with it, test_imports.py the package's import graph."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def timed_point(point):
    """A point's row holding when it ran (the wall clock: perf counters are per process)."""
    start = time.time()
    time.sleep(0.4)  # long enough for Ray to start a second worker process if it may use one
    return {"key": fadev.sweep.point_key(point), "start": start, "end": time.time()}
