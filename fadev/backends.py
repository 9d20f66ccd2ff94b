"""Where an attention kernel runs: one interface over fadev's backends, and the one kernel vocabulary.

A backend has three methods, each taking the call spec :class:`fadev._args.Call` that the API function built
once (policy, scale, causal, tiling, ring):

* ``forward(kernel, q4, k4, v4, call) -> (out, lse)``
* ``backward(kernel, q4, k4, v4, out4, lse3, dout4, call) -> (dq, dk, dv)``
* ``pieces(call) -> (flash, flash_backward)``: the per-piece functions a ring runs on host float64 arrays
  (:func:`fadev.ring_steps.forward` and ``backward`` take them; ``flash(q, k, v, policy, causal) -> (out, lse)``,
  ``flash_backward(q, k, v, out, lse, dout, policy, causal) -> (dq, dk, dv)``).

Backends: :data:`CPU` (the C core, fadev._core), :class:`Gpu` (the GPU's emulated kernels, fadev._core's cuda_*
methods through a :class:`fadev.cuda._Gpu`), :class:`Native` (the tensor-core kernels; forward and backward only,
their options in :class:`Native`) and PyTorch's SDPA (torch's own kernels; its ring pieces live with the torch
code that runs them, :mod:`fadev.distributed`). :func:`of` gives the backend of a routed call.
"""
from __future__ import annotations

from . import _core
from . import ring_steps as _steps
from .policy import Policy

KERNELS = {
    "baseline": "materialised attention, every intermediate rounded per a policy (CPU core or GPU emulation)",
    "flash": "FlashAttention's tiled online softmax, rounded per a policy (CPU core or GPU emulation)",
    "golden": "the fp64 reference (CPU: baseline under the golden policy; GPU: fadev's fp64 tensor-core kernel)",
    "ring": "flash pieces over a ring of ranks, merged per a RingMerge (CPU core; GPU: pieces on the GPU)",
    "native": "fadev's fp16 / bf16 tensor-core kernels (GPU; fixed arithmetic, no policy)",
    "sdpa": "PyTorch's scaled_dot_product_attention (torch's own kernels; fixed arithmetic, no policy)",
    "emulated": "a ring's pieces by the policy's flash kernel in fadev's emulation (CPU core or GPU; ring.c's bits)",
    "eager": "transformers' materialised attention (torch matmuls and softmax in the model's dtype; no policy)",
    "sdpa_flash": "PyTorch's scaled_dot_product_attention with its flash backend forced (no policy)",
}
"""The one kernel vocabulary: every ``kernel=`` option of fadev (fadev.torch, fadev.hf, fadev.distributed, the
sweep) takes names from it; each lists the subset it runs (:func:`subset`)."""
EMULATED = ("baseline", "flash")
"""The kernels that run under a precision policy (a Policy, or a preset string)."""


def subset(*names) -> tuple:
    """``names``, each checked to be in :data:`KERNELS` (so a module's own list cannot drift from it)."""
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"not kernels of fadev.backends.KERNELS: {unknown}")
    return tuple(names)


class Cpu:
    """fadev's C core (fadev._core): every emulated kernel; the ring in one C call (csrc/ring.c)."""

    name = "cpu"
    impl = _core

    def forward(self, kernel, q4, k4, v4, call):
        if kernel == "golden" and self.impl is _core:  # the CPU's golden: baseline under the golden policy
            kernel, call = "baseline", call._replace(policy=Policy.golden())
        return getattr(self.impl, f"{kernel}_attention")(q4, k4, v4, call.c)

    def backward(self, kernel, q4, k4, v4, out4, lse3, dout4, call):
        return getattr(self.impl, f"{kernel}_attention_backward")(q4, k4, v4, out4, lse3, dout4, call.c)

    @staticmethod
    def pieces(call):
        return _steps.cpu_pieces(call)


CPU = Cpu()


class Gpu(Cpu):
    """The GPU's emulated kernels (the CPU's bits) for one routed call: ``gpu`` is its fadev.cuda._Gpu, whose
    methods take the core's arguments and which sets the kind of the results. The ring runs its pieces on the
    GPU and its merge and sums on the host (:mod:`fadev.ring_steps`: ring.c's order and rounding)."""

    name = "cuda"

    def __init__(self, gpu):
        self.impl = gpu

    def forward(self, kernel, q4, k4, v4, call):
        if kernel != "ring":
            return super().forward(kernel, q4, k4, v4, call)
        fmts, world_size, layout, allgather = call.ring.host(call.policy)
        q, k, v = (self.impl.to_host(x) for x in (q4, k4, v4))
        out, lse = _steps.forward(q, k, v, call.policy, fmts, world_size, layout, allgather, call.causal,
                                  self.pieces(call)[0])
        return self.impl.from_host(out), self.impl.from_host(lse)

    def backward(self, kernel, q4, k4, v4, out4, lse3, dout4, call):
        if kernel != "ring":
            return super().backward(kernel, q4, k4, v4, out4, lse3, dout4, call)
        fmts, world_size, layout, allgather = call.ring.host(call.policy)
        host = [self.impl.to_host(x) for x in (q4, k4, v4, out4, lse3, dout4)]
        grads = _steps.backward(*host, call.policy, fmts, world_size, layout, allgather, call.causal,
                                self.pieces(call)[1])
        return tuple(self.impl.from_host(g) for g in grads)

    @staticmethod
    def pieces(call):
        return _steps.gpu_pieces(call)


class Native:
    """fadev's tensor-core kernels for one routed call (``gpu``: its fadev.cuda._Gpu); ``options`` the native
    tuple (dtype code, deterministic, warp_rows, mma code) fadev.native builds. Their arithmetic is fixed (the
    call has no policy); no ring pieces here (fadev.distributed runs them on torch tensors)."""

    name = "native"

    def __init__(self, gpu, options):
        self.gpu, self.options = gpu, options

    def forward(self, kernel, q4, k4, v4, call):
        return self.gpu.native_forward(q4, k4, v4, call.c, self.options)

    def backward(self, kernel, q4, k4, v4, out4, lse3, dout4, call):
        return self.gpu.native_backward(q4, k4, v4, out4, lse3, dout4, call.c, self.options)


def of(gpu):
    """The backend of a call that :func:`fadev.cuda.route` routed: :data:`CPU` for None, else a :class:`Gpu`."""
    return CPU if gpu is None else Gpu(gpu)


__all__ = ["KERNELS", "EMULATED", "CPU", "Gpu", "Native", "of", "subset"]
