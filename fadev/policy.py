"""Precision policies: the format of every intermediate of attention.

A :class:`Policy` names one format per stage (docs/design.md, "Precision policy"); every
arithmetic result is rounded to the format of the stage it belongs to. Presets model real
computations; ``pol.replace(p="fp32")`` changes one stage.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from .formats import Format, ROUNDING_MODES, as_format, formats

STAGES = ("input", "score_acc", "score", "softmax", "sum_acc", "stats", "rescale", "p", "pv_acc", "out_acc",
          "state", "out")
"""Stage names in data-flow order. ``state`` may be None: O and l then keep out_acc and stats."""

STAGE_DOCS = {
    "input": "stored: Q, K, V rounded on entry",
    "score_acc": "accumulator: each Q.K dot product; products exact, each partial sum rounded",
    "score": "stored: S = scale * QK^T (the dot product rounded, then the scaled value)",
    "softmax": "stored: S - m, and exp(S - m)",
    "sum_acc": "accumulator: each row sum of exp(S - m) within one block",
    "stats": "stored: row sum l, its update a*l + rowsum (each term and the sum), LSE = m + log l",
    "rescale": "stored, flash only: a = exp(m_old - m_new) (the difference rounded too)",
    "p": "stored: P as fed to the P.V product (baseline: exp(S - m) / l)",
    "pv_acc": "accumulator: each P.V dot product within one block",
    "out_acc": "stored, flash only: running O between K/V blocks, O = a*O + PV, each step rounded",
    "state": "stored, flash kv_outer only: O and l as written to memory between K/V blocks (None: out_acc, stats)",
    "out": "stored: the output (flash deferred: O / l; baseline: the P.V result)",
}

BACKWARD_STAGES = ("bwd_p", "dsoft_p", "dp_acc", "dp", "delta_acc", "dsoft", "ds", "grad_acc", "dq_acc", "dkv_acc",
                   "grad")
"""Backward stage names (docs/numerics.md, "Backward"). None in the constructor derives them from the
forward stages: bwd_p = p, dp_acc = pv_acc, dp = score, delta_acc = sum_acc, dsoft = softmax, ds = p,
grad_acc = pv_acc, dq_acc = dkv_acc = out_acc, grad = out; and dsoft_p = dsoft (the backward stage)."""

BACKWARD_STAGE_DOCS = {
    "bwd_p": "stored: recomputed P as fed to the dV product",
    "dsoft_p": "stored: recomputed P as the softmax backward dS = P (dP - D) reads it",
    "dp_acc": "accumulator: each dP = dO.V dot product",
    "dp": "stored: dP as stored after its product",
    "delta_acc": "accumulator: D = rowsum(dO * O) (flash) / sum_j P*dP (baseline, as autograd)",
    "dsoft": "stored: the softmax-backward arithmetic: D, dP - D, P*(dP - D) (and scale*P*(dP - D): bwd_scale 'ds')",
    "ds": "stored: dS as fed to the dQ and dK products",
    "grad_acc": "accumulator: each dV, dK, dQ dot product within one block",
    "dq_acc": "stored: dQ accumulated across K/V blocks",
    "dkv_acc": "stored: dK, dV accumulated across query blocks (and query heads of a K/V group)",
    "grad": "stored: the returned gradients dq, dk, dv",
}

_BACKWARD_DEFAULTS = {"bwd_p": "p", "dsoft_p": "dsoft", "dp_acc": "pv_acc", "dp": "score", "delta_acc": "sum_acc", "dsoft": "softmax",
                      "ds": "p", "grad_acc": "pv_acc", "dq_acc": "out_acc", "dkv_acc": "out_acc", "grad": "out"}

PRESETS = ("golden", "paper", "naive", "fa2", "fa1", "efficient", "cudnn", "torch_math")
"""The one list of preset names (each a Policy classmethod; every one but golden takes a format): Policy.preset,
policy strings, the sweep's ``policy`` parameter and the tests read it."""
LOOP_ORDERS = ("q_outer", "kv_outer")
NORMALIZE = ("deferred", "eager")
EXP_FORMS = ("exp", "exp2")
BWD_SCALES = ("sums", "ds")
"""Where the backward multiplies by the softmax scale: the dQ, dK sums (FlashAttention-2) or each dS before its
rounding to ``ds`` (xformers' memory-efficient kernel)."""


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _acc(f: Format) -> Format:
    """A = fp32 when F is narrower than fp32, else F."""
    return formats["fp32"] if f.precision < 24 else f


def _fa_acc(f: Format) -> Format:
    """The flash kernels' registers: fp32, or F when F is wider."""
    return formats["fp32"] if f.precision <= 24 else f


_FA_IN_F = ("input", "p", "out", "bwd_p", "ds", "grad")
"""The stages a FlashAttention kernel stores in its input format F (P and dS feed tensor cores; the
softmax backward dS = P (dP - D) reads the fp32 P, not the rounded one)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Policy:
    """The format of every attention stage, the rounding mode, and the flash tiling defaults.

    Policies compare equal when every numeric field is equal (``name`` is a label, not compared).
    Presets are defined for any format F; "fp32" stages in the fa2/fa1/torch_math presets mean
    "fp32, or F when F is wider" (so ``Policy.fa2("fp64")`` is all fp64 arithmetic).

    Every field is a keyword argument: ``Policy(input="bf16", score_acc="fp32", ...)``. Stage fields take a
    :class:`~fadev.Format` or a name. ``rounding`` is "rne", "rtz" or "stochastic"
    (keyed by ``seed``). ``block_q``, ``block_kv``, ``loop_order``, ``normalize``, ``exp`` are what
    ``flash_attention`` uses when the caller passes None.
    """

    input: Format
    score_acc: Format
    score: Format
    softmax: Format
    sum_acc: Format
    stats: Format
    rescale: Format
    p: Format
    pv_acc: Format
    out_acc: Format
    state: Format | None
    out: Format
    bwd_p: Format | None = None
    dsoft_p: Format | None = None
    dp_acc: Format | None = None
    dp: Format | None = None
    delta_acc: Format | None = None
    dsoft: Format | None = None
    ds: Format | None = None
    grad_acc: Format | None = None
    dq_acc: Format | None = None
    dkv_acc: Format | None = None
    grad: Format | None = None
    rounding: str = "rne"
    seed: int = 0
    block_q: int = 64
    block_kv: int = 64
    loop_order: str = "q_outer"
    normalize: str = "deferred"
    exp: str = "exp"
    bwd_scale: str = "sums"
    name: str = dataclasses.field(default="custom", compare=False)

    def __post_init__(self):
        for stage in STAGES:
            value = getattr(self, stage)
            if stage == "state" and value is None:
                continue
            object.__setattr__(self, stage, as_format(value, name=stage))
        for stage in sorted(BACKWARD_STAGES, key=lambda s: s == "dsoft_p"):  # dsoft_p derives from dsoft
            value = getattr(self, stage)
            value = getattr(self, _BACKWARD_DEFAULTS[stage]) if value is None else as_format(value, name=stage)
            object.__setattr__(self, stage, value)
        if self.rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be 'rne', 'rtz' or 'stochastic', got {self.rounding!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2^64), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))
        for field in ("block_q", "block_kv"):
            v = getattr(self, field)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{field} must be a positive integer, got {v!r}")
            object.__setattr__(self, field, int(v))
        for field, allowed in (("loop_order", LOOP_ORDERS), ("normalize", NORMALIZE), ("exp", EXP_FORMS),
                               ("bwd_scale", BWD_SCALES)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {getattr(self, field)!r}")

    def replace(self, **changes) -> "Policy":
        """A copy with some fields changed, e.g. ``pol.replace(p="fp32", block_kv=128)``."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown policy field(s): {', '.join(sorted(unknown))}; stages are {', '.join(STAGES)}")
        if "name" not in changes and any(k in STAGES or k in BACKWARD_STAGES or k in ("rounding", "bwd_scale") for k in changes):
            changes["name"] = f"{self.name}+" + ",".join(f"{k}={changes[k]}" for k in sorted(changes))
        return dataclasses.replace(self, **changes)

    def stages(self, backward: bool = False) -> dict:
        """{stage: format name} of the forward stages (``state`` None when unset), and of the backward
        stages too when ``backward``."""
        names = STAGES + (BACKWARD_STAGES if backward else ())
        return {s: (getattr(self, s).name if getattr(self, s) is not None else None) for s in names}

    @property
    def state_out(self) -> Format:
        return self.state if self.state is not None else self.out_acc

    @property
    def state_stats(self) -> Format:
        return self.state if self.state is not None else self.stats

    def __str__(self):
        body = " ".join(f"{s}={getattr(self, s)}" for s in STAGES if getattr(self, s) is not None)
        return f"Policy[{self.name}]({body}, rounding={self.rounding})"

    @functools.cached_property  # a Policy is frozen: built once per policy, not per call (issue 24's host time)
    def _c(self):
        """The tuple the C binding turns into a fadev_policy."""
        fmts = [self.input, self.score_acc, self.score, self.softmax, self.sum_acc, self.stats, self.rescale, self.p,
                self.pv_acc, self.out_acc, self.state_out, self.state_stats, self.out]
        return tuple(f._c for f in fmts) + (ROUNDING_MODES[self.rounding], int(self.seed))

    @functools.cached_property
    def _c_backward(self):
        """The tuple the C binding turns into a fadev_policy_backward: the formats in BACKWARD_STAGES order, then
        1 when the scale multiplies dS (bwd_scale "ds"), else 0."""
        return tuple(getattr(self, s)._c for s in BACKWARD_STAGES) + (int(self.bwd_scale == "ds"),)

    # ------------------------------------------------------------ presets

    @classmethod
    def _split(cls, F: Format, A: Format, in_f: tuple, state=None, **options) -> "Policy":
        """The stages named in ``in_f`` in F, every other forward and backward stage in A (``state`` as
        given: None or F)."""
        stages = {s: F if s in in_f else A for s in STAGES + BACKWARD_STAGES if s != "state"}
        return cls(**stages, state=state, **options)

    @classmethod
    def golden(cls) -> "Policy":
        """Every stage in fp64: the reference answer."""
        f = formats["fp64"]
        return cls._split(f, f, (), name="golden")

    @classmethod
    def paper(cls, fmt) -> "Policy":
        """Golden et al.'s microbenchmark: flash attention re-implemented with PyTorch tensors in F.
        Every stored tensor is F; each matmul or reduction accumulates in A (fp32 for narrower F) as
        the tensor library does, and rounds its result to F."""
        F = as_format(fmt)
        return cls._split(F, _acc(F), ("input", "score", "softmax", "stats", "rescale", "p", "out_acc", "out",
                                       "bwd_p", "dsoft_p", "dp", "dsoft", "ds", "dq_acc", "dkv_acc", "grad"),
                          name=f"paper({F})")

    @classmethod
    def naive(cls, fmt) -> "Policy":
        """Standard PyTorch attention in F (matmul, fused softmax, matmul): the paper's baseline at F.
        The matmuls accumulate in A and round S and O to F; the fused softmax works in A and writes P in F."""
        F = as_format(fmt)
        return cls._split(F, _acc(F), ("input", "score", "p", "out", "bwd_p", "dp", "ds", "grad"),
                          name=f"naive({F})")

    @classmethod
    def fa2(cls, fmt) -> "Policy":
        """FlashAttention-2's CUDA kernel: scores, softmax and statistics in fp32 registers, P rounded
        to F for the tensor-core P.V product, O accumulated in fp32, written once in F. exp2 with log2(e)
        folded into the scale, deferred normalisation, query blocks outer, 128x64 tiles. Backward
        (flash_bwd_kernel.h): P recomputed in fp32 and rounded to F only for the tensor-core dV = P^T dO;
        dP in fp32; dS = P (dP - D) in fp32 registers from the fp32 P, D = rowsum(dO * O) in fp32 from the
        F output; dS rounded to F once, for both dQ = dS K and dK = dS^T Q; dQ accumulated in fp32 across
        K/V blocks (fp32 atomics), dK/dV in fp32 across query blocks; the scale applied to the fp32 sums,
        gradients written in F."""
        F = as_format(fmt)
        return cls._split(F, _fa_acc(F), _FA_IN_F, block_q=128, block_kv=64, loop_order="q_outer",
                          normalize="deferred", exp="exp2", name=f"fa2({F})")

    @classmethod
    def fa1(cls, fmt) -> "Policy":
        """FlashAttention-1: fp32 arithmetic as fa2, but K/V blocks outer (each query block's O and l
        written to memory in F between K/V blocks: state = F) and O renormalised every block (eager).
        Backward (fmha_dgrad_kernel_1xN_loop.h): the softmax backward in F (P and dP - D packed to F,
        multiplied with hmul), so dsoft = F; this also rounds D to F, which FA1 keeps in fp32."""
        F = as_format(fmt)
        return cls._split(F, _fa_acc(F), _FA_IN_F + ("dsoft_p", "dsoft"), state=F, block_q=128, block_kv=128, loop_order="kv_outer",
                          normalize="eager", exp="exp", name=f"fa1({F})")

    @classmethod
    def efficient(cls, fmt) -> "Policy":
        """PyTorch's memory-efficient SDPA kernel (xformers' CUTLASS kernels, mem_eff_attention/kernel_backward.h):
        the forward as fa2 (fp32 registers, P in F for P.V, O in fp32, written in F) on 64x64 tiles. Backward:
        S = scale * K Q^T in fp32, P = exp(S - LSE) in fp32 (exp, not exp2), stored to shared memory in F and
        that F copy used both as the dV = P^T dO operand (bwd_p = F) and in dS = P (dP - D) (dsoft_p = F);
        dP, D and the softmax-backward arithmetic in fp32; the scale multiplies dS in fp32 before it is stored
        in F (bwd_scale "ds"), so dQ = dS K and dK = dS^T Q need no scale; dQ, dK, dV accumulated in fp32,
        written in F."""
        F = as_format(fmt)
        return cls._split(F, _fa_acc(F), _FA_IN_F + ("dsoft_p",), block_q=64, block_kv=64, loop_order="q_outer",
                          normalize="deferred", exp="exp", bwd_scale="ds", name=f"efficient({F})")

    @classmethod
    def cudnn(cls, fmt) -> "Policy":
        """cuDNN's fused flash attention (PyTorch's cuDNN SDPA backend; closed source, modelled from measurement):
        fa2's arithmetic on 64x64 tiles (its sm90 backward kernel is named ..._flash_bprop_wgmma_f16_..._64x64x64),
        except that the backward multiplies dS by the softmax scale in fp32 before rounding it to F (bwd_scale
        "ds"), as cudnn-frontend's open SM100 kernels do. At fp16 and long N that product underflows into fp16's
        subnormals; fa2's placement (the scale on the fp32 sums) does not (docs/numerics.md)."""
        F = as_format(fmt)
        return cls._split(F, _fa_acc(F), _FA_IN_F, block_q=64, block_kv=64, loop_order="q_outer",
                          normalize="deferred", exp="exp2", bwd_scale="ds", name=f"cudnn({F})")

    @classmethod
    def torch_math(cls, fmt) -> "Policy":
        """PyTorch SDPA's math backend on fp16/bf16: inputs upcast to fp32, everything in fp32, the
        output rounded to F."""
        F = as_format(fmt)
        return cls._split(F, _fa_acc(F), ("input", "out", "grad"), name=f"torch_math({F})")

    @classmethod
    def preset(cls, name: str, fmt=None) -> "Policy":
        """A preset by name: ``Policy.preset("fa2", "bf16")``, or ``Policy.preset("golden")``."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"preset: unknown preset {name!r}; known: {', '.join(PRESETS)}")
        if name == "golden":
            if fmt is not None:
                raise ValueError(f"fmt: preset 'golden' is all fp64 and takes no format, got {fmt!r}")
            return cls.golden()
        if fmt is None:
            raise ValueError(f"preset {name!r} needs a format, e.g. Policy.preset({name!r}, 'bf16')")
        return getattr(cls, name)(fmt)


_POLICY_TEXT = re.compile(r"\s*(\w+)\s*(?::\s*(\w+)|\(\s*(\w+)\s*\))?\s*")
"""A policy string: a preset name, then optionally ":format" or "(format)", nothing else."""


def as_policy(policy, name: str = "policy") -> Policy:
    """A Policy from a Policy, a preset name ("golden") or "preset:format" / "preset(format)" strings."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return _policy_of_text(policy, name)
    raise TypeError(f"{name}: expected a fadev.Policy or a preset name like 'fa2:bf16', got {type(policy).__name__}")


@functools.lru_cache(maxsize=256)
def _policy_of_text(policy: str, name: str) -> Policy:
    """A policy string's Policy, parsed once: a Policy is frozen, so every call with "fa2:bf16" shares one (and its
    cached C tuples); building it was a third of a GPU call's Python time. Errors are not cached."""
    match = _POLICY_TEXT.fullmatch(policy)
    if match is None:
        raise ValueError(f"{name}: malformed policy {policy!r}; expected a preset name ('golden') or "
                         f"'preset:format' / 'preset(format)', e.g. 'fa2:bf16'")
    preset, colon, paren = match.groups()
    try:
        return Policy.preset(preset, colon or paren)
    except ValueError as e:
        raise ValueError(f"{name} {policy!r}: {e}") from None
