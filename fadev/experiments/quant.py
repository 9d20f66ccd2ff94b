"""FP8 quantisation with scaling, and the randomised Hadamard rotation (FlashAttention-3 §3.3, §4.3).

Scaling, as FlashAttention-3's FP8 path uses it (and as fadev's experiments define it):

* **per-tensor**: one scale per (batch, head) tensor, ``s = amax / 448`` (448 = the largest E4M3FN
  value, ``fadev.formats["fp8_e4m3"].largest``); a value x is stored as ``round_e4m3(x / s)`` and used
  as ``s * round_e4m3(x / s)`` (de-quantised in fp64, relative error <= 2^-53; a kernel folds s into
  its fp32 epilogue instead, a difference far below the fp8 rounding).
* **block**: one scale per block of ``block`` consecutive rows of each (batch, head) matrix (block_q rows
  for Q, block_kv rows for K and V: the tiles the kernel loads), each ``amax(block) / 448``.

An all-zero tensor or block gets scale 1. :func:`hadamard` is the rotation FA3 calls incoherent
processing: ``x -> H (s * x) / sqrt(D)`` along the head dimension (csrc/hadamard.c), applied to Q and K
so that Q K^T is unchanged while a single large coordinate is spread over all D.
"""
from __future__ import annotations

import numbers

import numpy as np

from .. import _core
from ..formats import as_format
from ..formats import round as _round

SCALINGS = ("none", "tensor", "block")


def hadamard(x, signs=None, inverse=False):
    """Normalised Walsh-Hadamard rotation of each row of ``x`` along its last axis (length D = 2^k).

    ``inverse=False``: ``H (signs * x) / sqrt(D)``; ``inverse=True``: ``signs * (H x) / sqrt(D)``, so
    ``hadamard(hadamard(x, s), s, inverse=True)`` is x up to fp64 rounding. H is Sylvester's matrix
    (``scipy.linalg.hadamard``'s order); ``signs`` a length-D array of +-1 (None: all +1). Computed in
    C with D log2 D fp64 butterflies. Returns a new float64 array shaped like x.
    """
    arr = np.asarray(x)
    if arr.dtype.kind not in "biuf":
        raise TypeError(f"x: expected a real numeric array, got dtype {arr.dtype}")
    if arr.ndim < 1 or arr.size == 0:
        raise ValueError(f"x: expected a non-empty array with a last (head) axis, got shape {arr.shape}")
    dim = arr.shape[-1]
    if dim & (dim - 1):
        raise ValueError(f"x: the last axis must have a power-of-two length for the Hadamard transform, got {dim}")
    s = None
    if signs is not None:
        s = np.asarray(signs, dtype=np.float64)
        if s.shape != (dim,):
            raise ValueError(f"signs: expected shape ({dim},), got {s.shape}")
        if not np.all(np.abs(s) == 1.0):
            raise ValueError(f"signs: every entry must be +1 or -1, got {s[np.abs(s) != 1.0][:3]}")
    if not isinstance(inverse, (bool, np.bool_)):
        raise TypeError(f"inverse must be a bool, got {inverse!r}")
    return _core.hadamard(np.ascontiguousarray(arr, dtype=np.float64), s, bool(inverse))


def random_signs(dim, seed=0):
    """D reproducible random +-1 values (numpy PCG64(seed)): the diagonal of the randomised rotation."""
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    rng = np.random.Generator(np.random.PCG64(int(seed)))
    return np.where(rng.random(int(dim)) < 0.5, -1.0, 1.0)


def quantize(x, fmt="fp8_e4m3", scaling="tensor", block=None):
    """De-quantised values of ``x`` (..., N, D) stored in ``fmt`` with the given scaling.

    ``scaling``: "none" (round x itself), "tensor" (one scale ``amax / largest`` per (..., N, D) matrix,
    i.e. per batch and head) or "block" (one scale per ``block`` consecutive rows of each matrix; the last
    block may be short). Returns ``(values, scales)``: values = scale * round(x / scale) in float64 (one
    fp64 rounding of the product) and the scales, shaped (..., n_blocks) (n_blocks = 1 for
    "tensor"; empty for "none"). Rounding is nearest-even; x / scale never exceeds ``largest`` in magnitude.
    """
    f = as_format(fmt)
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim < 2:
        raise ValueError(f"x: expected an array of shape (..., N, D), got shape {arr.shape}")
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    if scaling == "none":
        if block is not None:
            raise ValueError(f"block is only used with scaling='block', got block={block!r}")
        return _round(arr, f), np.empty(arr.shape[:-2] + (0,))
    n = arr.shape[-2]
    if scaling == "tensor":
        if block is not None:
            raise ValueError(f"block is only used with scaling='block', got block={block!r}")
        block = n
    elif isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
        raise ValueError(f"block must be a positive integer with scaling='block', got {block!r}")
    block = int(block)
    n_blocks = -(-n // block)
    pad = n_blocks * block - n
    padded = np.concatenate([arr, np.zeros(arr.shape[:-2] + (pad, arr.shape[-1]))], axis=-2) if pad else arr
    tiles = padded.reshape(arr.shape[:-2] + (n_blocks, block, arr.shape[-1]))
    amax = np.abs(tiles).max(axis=(-2, -1))
    scales = np.where(amax > 0, amax / f.largest, 1.0)
    # x / s can land a rounding above `largest` by an ulp of fp64 when x is the amax itself: clip first.
    scaled = np.clip(tiles / scales[..., None, None], -f.largest, f.largest)
    values = (_round(scaled, f) * scales[..., None, None]).reshape(padded.shape)
    return values[..., :n, :], scales


__all__ = ["hadamard", "random_signs", "quantize", "SCALINGS"]
