"""Sweep points: the parameters a point may name (:data:`PARAMS`), their validation and canonical form,
the key a point is stored under (:func:`point_key`), grids of points (:func:`expand`), and the kernels a
point can run on each device (:data:`KERNELS`)."""
from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import math
import numbers

import numpy as np

from .. import cuda_available
from ..attention import DISTRIBUTIONS, MAX_DIM, baseline_attention, flash_attention
from ..backends import subset
from ..formats import ROUNDING_MODES, Format, as_format, formats
from ..policy import EXP_FORMS, LOOP_ORDERS, NORMALIZE, PRESETS, STAGES, Policy, as_policy

MAX_SEQ = 2**20
"""Largest N / N_kv a sweep accepts (stochastic rounding allows < 2^21)."""

_FLASH_ONLY = ("block_q", "block_kv", "sram_bytes", "loop_order", "normalize", "exp")
_REF_FIELDS = ("policy", "rounding", "rounding_seed") + _FLASH_ONLY

PARAMS = {
    "kernel": ("flash", "test run's kernel: 'flash' or 'baseline'"),
    "policy": ("paper:bf16", f"test run's policy preset: 'golden' or 'PRESET:FORMAT' "
                             f"({', '.join(p for p in PRESETS if p != 'golden')}; e.g. 'fa2:bf16'); stage overrides "
                             f"as 'stage.NAME'"),
    "rounding": (None, "rounding mode 'rne', 'rtz' or 'stochastic' (None: the preset's, rne)"),
    "rounding_seed": (None, "stochastic-rounding seed (None: the point's seed); None unless rounding is stochastic"),
    "block_q": (None, "flash: query block Br (None: the policy's); None for baseline"),
    "block_kv": (None, "flash: key/value block Bc (None: the policy's); None for baseline"),
    "sram_bytes": (None, "flash: tiles by FlashAttention-1's rule Bc = ceil(M/4D), Br = min(Bc, D)"),
    "loop_order": (None, "flash: 'q_outer' or 'kv_outer' (None: the policy's)"),
    "normalize": (None, "flash: 'deferred' or 'eager' (None: the policy's)"),
    "exp": (None, "flash: 'exp' or 'exp2' (None: the policy's)"),
    "causal": (False, "causal mask (bottom-right aligned)"),
    "scale": (None, "softmax scale (None: 1/sqrt(D))"),
    "batch": (1, "batch size B"),
    "heads": (1, "query heads H"),
    "heads_kv": (None, "key/value heads (grouped-query; must divide heads; None: heads)"),
    "N": (256, f"query sequence length, 1..{MAX_SEQ}"),
    "N_kv": (None, "key/value sequence length (None: N)"),
    "D": (64, f"head dimension, 1..{MAX_DIM}"),
    "dist": ("normal", "input distribution: " + ", ".join(DISTRIBUTIONS)),
    "seed": (0, "input seed (numpy PCG64), a non-negative integer"),
    "input_fmt": ("policy", "inputs rounded to this format before every run and golden ('policy': the test "
                            "policy's input format; 'fp64': raw draws)"),
    "device": ("cpu", "device of every run: 'cpu' or 'cuda' (golden there: fadev.golden_attention, fp64 MMA)"),
    "golden": (True, "compare with golden (vs_golden.*, ref_vs_golden.*)"),
    "lse": (False, "also compare the log-sum-exp (lse_vs_golden.*, lse_vs_ref.*, lse_ref_vs_golden.*)"),
    "ref_kernel": (None, "second run to compare with: 'flash' or 'baseline' (None: none)"),
    "ref_policy": (None, "ref run's preset (None: the test run's full policy, overrides and rounding included)"),
    "ref_rounding": (None, "ref run's rounding override"),
    "ref_rounding_seed": (None, "ref run's stochastic-rounding seed (None: the point's seed)"),
    "ref_block_q": (None, "ref run's flash tiling (None: the ref policy's)"),
    "ref_block_kv": (None, "ref run's flash tiling"),
    "ref_sram_bytes": (None, "ref run's flash tiling by FlashAttention-1's rule"),
    "ref_loop_order": (None, "ref run's loop order"),
    "ref_normalize": (None, "ref run's normalisation"),
    "ref_exp": (None, "ref run's exp form"),
}
"""{name: (default, description)} of every point parameter. Besides these: ``stage.NAME`` and
``ref_stage.NAME`` (a format per policy stage; input aliases ``override`` / ``ref_override``: a dict
{stage: format}) and ``tag.NAME`` (a free label: str, int, float or bool)."""

_PREFIXES = ("stage.", "ref_stage.", "tag.")
_KERNELS = subset("flash", "baseline")
METRICS = ("max_abs", "mean_diff", "std_diff", "mean_abs", "rmse", "rel_l2", "max_rel", "wasserstein")
"""The float metrics of each compared pair (rows also hold the counts n, n_nan, n_inf)."""

KERNELS = {}
"""{(kernel, device): fn(q, k, v, policy, causal, scale, tiles) -> (out, lse)}; GPU kernels register here."""
KERNELS[("baseline", "cpu")] = lambda q, k, v, pol, causal, scale, tiles: baseline_attention(
    q, k, v, pol, causal=causal, scale=scale, return_lse=True)
KERNELS[("flash", "cpu")] = lambda q, k, v, pol, causal, scale, tiles: flash_attention(
    q, k, v, pol, causal=causal, scale=scale, return_lse=True, **tiles)
KERNELS[("baseline", "cuda")] = lambda q, k, v, pol, causal, scale, tiles: baseline_attention(
    q, k, v, pol, causal=causal, scale=scale, return_lse=True, device="cuda")
KERNELS[("flash", "cuda")] = lambda q, k, v, pol, causal, scale, tiles: flash_attention(
    q, k, v, pol, causal=causal, scale=scale, return_lse=True, device="cuda", **tiles)


class _Bad(Exception):
    """One problem with one parameter value (collected, then raised together as ValueError)."""


# ------------------------------------------------------------------ validation and canonical form

def _is_int(v):
    return isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, (bool, np.bool_))


def _int(lo, hi):
    def check(v):
        if not _is_int(v):
            raise _Bad(f"must be an integer, got {v!r}")
        if not lo <= int(v) <= hi:
            raise _Bad(f"must be in [{lo}, {hi}], got {v!r}")
        return int(v)
    return check


def _choice(*allowed):
    def check(v):
        if v not in allowed:
            raise _Bad(f"must be one of {', '.join(map(repr, allowed))}, got {v!r}")
        return v
    return check


def _bool(v):
    if not isinstance(v, (bool, np.bool_)):
        raise _Bad(f"must be true or false, got {v!r}")
    return bool(v)


def _fmt(v):
    if isinstance(v, Format):
        if formats.get(v.name) == v:
            return v.name
        raise _Bad(f"custom format {v.name!r} cannot be named in a sweep; use a built-in: {', '.join(formats)}")
    if not isinstance(v, str):
        raise _Bad(f"must be a format name ({', '.join(formats)}), got {v!r}")
    try:
        return as_format(v).name
    except ValueError:
        raise _Bad(f"unknown format {v!r}; known: {', '.join(formats)}") from None


def _policy(v):
    """Canonical preset string: 'golden' or 'PRESET:FORMAT'."""
    if isinstance(v, Policy):
        try:
            ok = _policy(v.name.replace("(", ":").rstrip(")"))
        except _Bad:
            ok = None
        if ok is None or as_policy(ok) != v:
            raise _Bad(f"a Policy object must be an unmodified preset, got {v.name!r}; name the preset "
                       f"('paper:bf16') and give stage.NAME overrides")
        return ok
    if not isinstance(v, str):
        raise _Bad(f"must be a preset string like 'paper:bf16', got {v!r}")
    preset, fmt = v.strip(), None
    for sep in (":", "("):
        if sep in preset:
            preset, fmt = (part.strip() for part in preset.split(sep, 1))
            fmt = fmt.rstrip(")").strip()
            break
    if preset not in PRESETS:
        raise _Bad(f"unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    if preset == "golden":
        if fmt is not None:
            raise _Bad(f"'golden' takes no format (it is all fp64), got {v!r}")
        return "golden"
    if not fmt:
        raise _Bad(f"preset {preset!r} needs a format, e.g. '{preset}:bf16', got {v!r}")
    return f"{preset}:{_fmt(fmt)}"


def _rounding(v):
    if v not in ROUNDING_MODES:
        raise _Bad(f"must be one of 'rne', 'rtz', 'stochastic', got {v!r}")
    return {0: "rne", 1: "rtz", 2: "stochastic"}[ROUNDING_MODES[v]]


def _scale(v):
    if not isinstance(v, (numbers.Real, np.floating, np.integer)) or isinstance(v, (bool, np.bool_)) \
            or not math.isfinite(float(v)):
        raise _Bad(f"must be a finite number, got {v!r}")
    return float(v)


def _tag(v):
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if _is_int(v):
        return int(v)
    if isinstance(v, (float, np.floating)) and math.isfinite(v):
        return float(v)
    if isinstance(v, str) and v.isprintable():
        return v
    raise _Bad(f"must be a printable string, an integer, a finite number or a bool, got {v!r}")


_TILE = _int(1, 2**31 - 1)
_CHECKS = {
    "kernel": _choice(*_KERNELS), "policy": _policy, "rounding": _rounding,
    "rounding_seed": _int(0, 2**64 - 1), "block_q": _TILE, "block_kv": _TILE, "sram_bytes": _TILE,
    "loop_order": _choice(*LOOP_ORDERS), "normalize": _choice(*NORMALIZE), "exp": _choice(*EXP_FORMS),
    "causal": _bool, "scale": _scale, "batch": _int(1, 2**16), "heads": _int(1, 2**16), "heads_kv": _int(1, 2**16),
    "N": _int(1, MAX_SEQ), "N_kv": _int(1, MAX_SEQ), "D": _int(1, MAX_DIM), "dist": _choice(*DISTRIBUTIONS),
    "seed": _int(0, 2**63 - 1), "input_fmt": lambda v: v if v == "policy" else _fmt(v),
    "device": _choice("cpu", "cuda"), "golden": _bool, "lse": _bool, "ref_kernel": _choice(*_KERNELS),
}
for _f in _REF_FIELDS:
    _CHECKS["ref_" + _f] = _CHECKS[_f]
_INT_PARAMS = {"rounding_seed", "block_q", "block_kv", "sram_bytes", "batch", "heads", "heads_kv", "N", "N_kv", "D",
               "seed", "ref_rounding_seed", "ref_block_q", "ref_block_kv", "ref_sram_bytes"}


def _flatten_input(point):
    """Expand 'override' / 'ref_override' / nested 'stage' / 'ref_stage' / 'tag' dicts into flat keys."""
    flat, problems = {}, []
    for name, value in point.items():
        if not isinstance(name, str):
            problems.append(f"parameter names must be strings, got {name!r}")
            continue
        alias = {"override": "stage", "ref_override": "ref_stage"}.get(name, name)
        if alias in ("stage", "ref_stage", "tag") and isinstance(value, dict):
            pairs = [(f"{alias}.{sub}", v) for sub, v in value.items()]
        elif name in ("override", "ref_override"):
            problems.append(f"{name}: must be a table {{stage: format}}, got {value!r}")
            continue
        else:
            pairs = [(name, value)]
        for key, v in pairs:
            if key in flat:
                problems.append(f"{key}: given twice (as {key!r} and inside an override/stage table)")
            flat[key] = v
    return flat, problems


def _canonical(point):
    """(canonical point, [problems]) -- never raises for bad values."""
    if not isinstance(point, dict):
        return None, [f"a point must be a dict of parameters, got {type(point).__name__}"]
    flat, problems = _flatten_input(point)
    out = {}
    for name, (default, _doc) in PARAMS.items():
        value = flat.get(name, default)
        if value is None and default is not None:
            problems.append(f"{name}: must not be None (default {default!r})")
            value = default
        if value is None or name not in _CHECKS:
            out[name] = value
            continue
        try:
            out[name] = _CHECKS[name](value)
        except _Bad as e:
            problems.append(f"{name}: {e}")
            out[name] = default
    extra = {}
    for name in flat:
        if name in PARAMS:
            continue
        prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
        if prefix is None:
            near = difflib.get_close_matches(name, list(PARAMS) + ["stage.p", "ref_stage.p", "tag.NAME"], 1)
            problems.append(f"unknown parameter {name!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
            continue
        sub, value = name[len(prefix):], flat[name]
        try:
            if prefix == "tag.":
                if not sub:
                    raise _Bad("tag needs a name: tag.NAME")
                if value is not None:
                    extra[name] = _tag(value)
            elif sub not in STAGES:
                raise _Bad(f"unknown stage {sub!r}; stages: {', '.join(STAGES)}")
            elif value is not None:
                extra[name] = _fmt(value)
        except _Bad as e:
            problems.append(f"{name}: {e}")
    problems += _normalise(out, extra)
    order = {s: i for i, s in enumerate(STAGES)}
    for prefix in _PREFIXES:
        keys = [k for k in extra if k.startswith(prefix)]
        keys.sort(key=lambda k: (order.get(k[len(prefix):], 0), k))
        out.update((k, extra[k]) for k in keys)
    return out, problems


def _normalise(p, extra):
    """Cross-parameter checks; drops parameters that do not apply (so equal runs share one key)."""
    problems = []
    if p["ref_kernel"] is None:
        stray = [f"ref_{f}" for f in _REF_FIELDS if p[f"ref_{f}"] is not None]
        stray += [k for k in extra if k.startswith("ref_stage.")]
        if stray:
            problems.append(f"{', '.join(stray)} set but ref_kernel is None (name the ref run's kernel)")
        for f in _REF_FIELDS:
            p["ref_" + f] = None
        for k in [k for k in extra if k.startswith("ref_stage.")]:
            del extra[k]
    for pre in ("", "ref_"):
        if p[pre + "kernel"] == "baseline":
            for f in _FLASH_ONLY:
                p[pre + f] = None
        if p[pre + "sram_bytes"] is not None and (p[pre + "block_q"] is not None or p[pre + "block_kv"] is not None):
            problems.append(f"{pre}sram_bytes derives {pre}block_q and {pre}block_kv; do not set them too "
                            f"(got {pre}block_q={p[pre + 'block_q']!r}, {pre}block_kv={p[pre + 'block_kv']!r})")
    if not p["golden"] and p["ref_kernel"] is None:
        problems.append("golden is false and ref_kernel is None: the point compares nothing")
    if p["heads_kv"] is not None and p["heads"] % p["heads_kv"]:
        problems.append(f"heads_kv={p['heads_kv']} must divide heads={p['heads']}")
    if p["N_kv"] == p["N"]:
        p["N_kv"] = None
    if p["heads_kv"] == p["heads"]:
        p["heads_kv"] = None
    if p["device"] == "cuda":
        if not cuda_available():
            problems.append("device='cuda' but no CUDA device is usable (fadev.cuda_available() is False: "
                            "build with FADEV_CUDA=1 on a machine with a GPU, or use device='cpu')")
        else:
            for pre in ("", "ref_"):
                kernel = p[pre + "kernel"]
                if kernel is not None and (kernel, "cuda") not in KERNELS:
                    problems.append(f"{pre}kernel={kernel!r} has no CUDA implementation in this build")
    for pre in ("", "ref_"):
        if pre == "ref_" and p["ref_kernel"] is None:
            continue
        try:
            pol = _build_policy(p, extra, pre)
        except (ValueError, TypeError) as e:
            problems.append(f"{pre}policy: {e}")
            continue
        if pol.rounding != "stochastic":
            p[pre + "rounding_seed"] = None
    return problems


def _build_policy(p, extra, pre=""):
    """The Policy of the test run (pre='') or the ref run (pre='ref_')."""
    if pre and p["ref_policy"] is None:
        pol = _build_policy(p, extra, "")
    else:
        pol = as_policy(p[pre + "policy"])
    stages = {k[len(pre) + 6:]: v for k, v in extra.items() if k.startswith(pre + "stage.")}
    changes = dict(stages)
    if p[pre + "rounding"] is not None:
        changes["rounding"] = p[pre + "rounding"]
    return pol.replace(**changes) if changes else pol


def canonical(point):
    """The point with every parameter present, defaults filled in, names and values canonical
    ('paper(bfloat16)' -> 'paper:bf16', override dicts -> 'stage.NAME' keys, parameters that do not
    apply set to None). Raises one ValueError listing every problem."""
    out, problems = _canonical(point)
    if problems:
        raise ValueError("invalid sweep point:\n  " + "\n  ".join(problems))
    return out


def _ranges(indices):
    parts, start = [], None
    for i, j in zip(indices, indices[1:] + [None]):
        start = i if start is None else start
        if j != i + 1:
            parts.append(f"{start}" if start == i else f"{start}-{i}")
            start = None
    return ", ".join(parts)


def validate(points):
    """Canonical form of every point, checking all of them before returning. Raises ONE ValueError that
    lists every distinct problem with the indices of the points it occurs in."""
    if isinstance(points, dict):
        points = [points]
    canon, where = [], {}
    for i, point in enumerate(points):
        out, problems = _canonical(point)
        for msg in dict.fromkeys(problems):
            where.setdefault(msg, []).append(i)
        canon.append(out)
    if where:
        n_bad = len(set().union(*map(set, where.values())))
        lines = [f"  - {msg}  [point{'s' if len(ix) > 1 else ''} {_ranges(ix)}]" for msg, ix in where.items()]
        raise ValueError(f"{n_bad} of {len(canon)} sweep points are invalid ({len(where)} problems):\n" +
                         "\n".join(lines))
    return canon


def point_key(point) -> str:
    """Canonical hash (16 hex digits) of a point's parameters: the row key used to skip finished points.

    Parameters at their default are left out of the hash, so a parameter added later (defaulting to the
    old behaviour) keeps old results files valid; a default must therefore never change meaning."""
    p = canonical(point)
    text = json.dumps({k: v for k, v in p.items() if k not in PARAMS or v != PARAMS[k][0]}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def expand(grid=None, points=None, base=None):
    """Points of a sweep: every combination of ``grid`` ({name: [values]}: cartesian product, in key
    order, the last key varying fastest) combined with every entry of ``points`` (a list of dicts), all on
    top of ``base`` ({name: value}). With only a grid or only points, that one alone; neither: [base].
    A name given by both a point and the grid (or twice) is an error. Points are not validated here."""
    base, grid = dict(base or {}), dict(grid or {})
    for name, values in list(grid.items()):
        if isinstance(values, dict) and name in ("stage", "ref_stage", "tag"):
            del grid[name]
            grid.update({f"{name}.{k}": v for k, v in values.items()})
    problems = [f"grid[{name!r}] must be a list of values, got {values!r} (fixed values go in base)"
                for name, values in grid.items() if not isinstance(values, (list, tuple))]
    problems += [f"grid[{name!r}] is empty" for name, values in grid.items()
                 if isinstance(values, (list, tuple)) and not values]
    if problems:
        raise ValueError("invalid sweep grid:\n  " + "\n  ".join(problems))
    names = list(grid)
    combos = [dict(zip(names, values)) for values in itertools.product(*(grid[n] for n in names))]
    listed = list(points) if points is not None else [{}]
    if points is not None and not listed:
        raise ValueError("points is an empty list")
    result = []
    for entry in listed:
        if not isinstance(entry, dict):
            raise ValueError(f"each entry of points must be a dict, got {entry!r}")
        clash = sorted(set(entry) & set(names))
        if clash:
            raise ValueError(f"point {entry!r} sets {', '.join(clash)}, which the grid also varies")
        for combo in combos:
            result.append({**base, **entry, **combo})
    return result
