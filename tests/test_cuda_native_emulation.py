"""The native tensor-core kernels (fadev.native_attention and its backward) against the emulation of the same
computation.

The issue's second rule for the native kernel: its error against the fp64 golden answer must match the
error statistics of the ``fa2(F)`` emulation run with the same tiles (mean and max |error| within 15%), so
that what the emulation shows about tiles and formats can be trusted to hold for a production-style kernel.
Every compiled tile of each direction (``fadev.native_tiles(D)``, ``native_tiles(D, backward=True)``); the
backward in both of its dq modes. Inputs are exact in F (both kernels see the same values); the golden
answers are fp64. Skipped without a CUDA device.
"""
import numpy as np
import pytest

import fadev
from helpers import needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu]

CASES = [(fmt, D, causal) for fmt in ("bf16", "fp16") for D in (64, 128) for causal in (False, True)]


def _assert_matches(name, native, emulated, gold, context):
    e_nat, e_emu = np.abs(native - gold), np.abs(emulated - gold)
    for stat in (np.mean, np.max):
        a, b = float(stat(e_nat)), float(stat(e_emu))
        assert abs(a - b) <= 0.15 * b, (f"{context} {name}: {stat.__name__} |error| native {a:.3e} vs fa2 "
                                        f"emulation {b:.3e}")


@pytest.mark.parametrize("fmt,D,causal", CASES, ids=lambda x: str(x))
def test_native_error_statistics_match_fa2_emulation(fmt, D, causal):
    q, k, v = fadev.random_qkv((1, 4, 1024, D), dist="normal", seed=3, fmt=fmt)
    gold = fadev.baseline_attention(q, k, v, "golden", causal=causal)
    for block_q, block_kv in fadev.native_tiles(D):
        native = fadev.native_attention(q, k, v, causal=causal, block_q=block_q, block_kv=block_kv, dtype=fmt)
        emulated = fadev.flash_attention(q, k, v, f"fa2:{fmt}", causal=causal, block_q=block_q, block_kv=block_kv,
                                         device="cuda")
        _assert_matches("out", native, emulated, gold, f"{fmt} D={D} causal={causal} tile {block_q}x{block_kv}")


@pytest.mark.parametrize("fmt,D,causal", CASES, ids=lambda x: str(x))
def test_native_backward_error_statistics_match_fa2_emulation(fmt, D, causal):
    """dq, dk, dv: the native backward (atomic and deterministic dq) against fa2's emulated backward with the same
    (block_q, block_kv), each from its own forward (the native forward's default tile; the emulation's with the
    same tile), all against golden gradients (the emulated golden policy, fp64 at every stage)."""
    q, k, v = fadev.random_qkv((1, 4, 512, D), dist="normal", seed=5, fmt=fmt)
    dout = fadev.round(np.random.default_rng(6).standard_normal(q.shape), fmt)
    out, lse = fadev.flash_attention(q, k, v, "golden", causal=causal, return_lse=True, device="cuda")
    gold = fadev.flash_attention_backward(q, k, v, out, lse, dout, "golden", causal=causal, device="cuda")
    fq, fkv = fadev.native_tiles(D)[0]
    n_out, n_lse = fadev.native_attention(q, k, v, causal=causal, return_lse=True, dtype=fmt)
    pol = f"fa2:{fmt}"
    e_out, e_lse = fadev.flash_attention(q, k, v, pol, causal=causal, block_q=fq, block_kv=fkv, return_lse=True,
                                         device="cuda")
    for block_q, block_kv in fadev.native_tiles(D, backward=True):
        emulated = fadev.flash_attention_backward(q, k, v, e_out, e_lse, dout, pol, causal=causal, block_q=block_q,
                                                  block_kv=block_kv, device="cuda")
        for deterministic in (False, True):
            native = fadev.native_attention_backward(q, k, v, n_out, n_lse, dout, causal=causal, block_q=block_q,
                                                     block_kv=block_kv, deterministic=deterministic, dtype=fmt)
            context = f"{fmt} D={D} causal={causal} tile {block_q}x{block_kv} deterministic={deterministic}"
            for name, n, e, g in zip(("dq", "dk", "dv"), native, emulated, gold):
                _assert_matches(name, n, e, g, context)
