"""The reproduction experiments (fadev/experiments/) at tiny sizes: the directions the paper's findings and
fadev's design require, the Hadamard rotation (csrc/hadamard.c) against scipy, and fp8 quantisation.

Directions are asserted on means over seeds with margins far above the seed-to-seed spread measured at
these sizes (the report's ± columns); identities are asserted bit for bit."""
import math

import numpy as np
import pytest
import pandas as pd
import scipy.linalg

import fadev
from fadev import Policy, baseline_attention, compare, flash_attention, random_qkv
from fadev.experiments import algorithm, attribution, common, fp8, kernels, precision, ring, seqlen
from fadev.experiments.quant import hadamard, quantize, random_signs

U = 2.0**-53


# ------------------------------------------------------------------ Hadamard rotation

@pytest.mark.parametrize("dim", [1, 2, 4, 8, 64, 128, 256])
def test_hadamard_of_identity_is_scipys_matrix(dim):
    got = hadamard(np.eye(dim))
    want = scipy.linalg.hadamard(dim) * (1.0 / math.sqrt(dim))  # rows of H are its columns: H is symmetric
    assert np.array_equal(got, want)  # sums of one +-1 each, then one fp64 multiplication: exact


@pytest.mark.parametrize("dim", [2, 16, 128])
def test_hadamard_matches_scipy_and_is_orthogonal(dim, rng):
    x = rng.standard_normal((3, 5, dim))
    signs = random_signs(dim, seed=3)
    y = hadamard(x, signs)
    h = scipy.linalg.hadamard(dim) / math.sqrt(dim)
    bound = (2 * math.log2(dim) + 2) * U * np.linalg.norm(x, axis=-1, keepdims=True)  # log2 D butterfly stages
    assert np.all(np.linalg.norm(y - (x * signs) @ h.T, axis=-1, keepdims=True) <= 2 * bound)
    assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=2 * (math.log2(dim) + 1) * U * 4)
    m = hadamard(np.eye(dim), signs)
    assert np.max(np.abs(m @ m.T - np.eye(dim))) <= dim * U * 2  # each entry a D-term fp64 dot product
    back = hadamard(y, signs, inverse=True)
    assert np.all(np.linalg.norm(back - x, axis=-1, keepdims=True) <= 4 * bound)


def test_hadamard_leaves_scores_unchanged(rng):
    q, k = rng.standard_normal((8, 64)), rng.standard_normal((16, 64))
    s = random_signs(64, seed=1)
    qr, kr = hadamard(q, s), hadamard(k, s)
    scores = q @ k.T
    bound = 8 * (math.log2(64) + 2) * U * np.outer(np.linalg.norm(q, axis=1), np.linalg.norm(k, axis=1))
    assert np.all(np.abs(qr @ kr.T - scores) <= bound)


def test_hadamard_in_place_and_random_signs():
    s = random_signs(32, seed=5)
    assert set(np.unique(s)) == {-1.0, 1.0} and np.array_equal(s, random_signs(32, seed=5))
    x = np.arange(64.0).reshape(2, 32)
    assert np.array_equal(fadev._core.hadamard(x, s, False), hadamard(x, s))


@pytest.mark.parametrize("args, kind, match", [
    ((np.ones((2, 6)),), ValueError, "power-of-two"),
    ((np.ones((2, 0)),), ValueError, "non-empty"),
    ((np.ones(()),), ValueError, "non-empty"),
    ((np.array(["a", "b"]),), TypeError, "real numeric"),
    ((np.ones((2, 4)), np.ones(3)), ValueError, r"signs: expected shape \(4,\)"),
    ((np.ones((2, 4)), np.array([1.0, -1.0, 0.5, 1.0])), ValueError, "signs: every entry"),
])
def test_hadamard_errors(args, kind, match):
    with pytest.raises(kind, match=match):
        hadamard(*args)


def test_hadamard_errors_other_arguments():
    with pytest.raises(TypeError, match="inverse must be a bool"):
        hadamard(np.ones((1, 4)), inverse=1)
    with pytest.raises(ValueError, match="dim must be a positive integer"):
        random_signs(0)
    # the binding's own checks (the C status codes)
    with pytest.raises(ValueError, match="power of two"):
        fadev._core.hadamard(np.ones((2, 6)), None, False)
    with pytest.raises(ValueError, match="power of two"):
        fadev._core.hadamard(np.ones((1, 2)), np.array([1.0, 2.0]), False)
    with pytest.raises(ValueError, match="signs: expected shape"):
        fadev._core.hadamard(np.ones((1, 2)), np.ones(3), False)


# ------------------------------------------------------------------ fp8 quantisation

def test_quantize_per_tensor_scale_and_grid(rng):
    x = rng.standard_normal((2, 3, 40, 8)) * 5
    values, scales = quantize(x, "fp8_e4m3", "tensor")
    amax = np.abs(x).max(axis=(-2, -1))
    assert scales.shape == (2, 3, 1) and np.array_equal(scales[..., 0], amax / 448)
    stored = values / scales[..., None]
    assert np.allclose(fadev.round(stored, "fp8_e4m3"), stored, rtol=4 * U, atol=0)  # on the e4m3 grid
    assert np.abs(stored).max() <= 448 * (1 + 4 * U)
    rel = np.abs(values - x) / np.abs(x)
    normal = np.abs(x) / scales[..., None] >= 2.0**-6
    assert rel[normal].max() <= 2.0**-4 * (1 + 1e-12)  # E4M3: 4 significant bits, u = 2^-4


def test_quantize_block_scales_per_row_block(rng):
    x = rng.standard_normal((1, 1, 10, 4))
    x[0, 0, 7, 2] = 100.0  # an outlier in the second block
    values, scales = quantize(x, "fp8_e4m3", "block", block=4)
    assert scales.shape == (1, 1, 3)
    want = [np.abs(x[0, 0, i:i + 4]).max() / 448 for i in (0, 4, 8)]
    assert np.array_equal(scales[0, 0], want)
    first_block_error = np.abs(values[0, 0, :4] - x[0, 0, :4]).max()
    tensor_values, _ = quantize(x, "fp8_e4m3", "tensor")
    assert first_block_error <= np.abs(tensor_values[0, 0, :4] - x[0, 0, :4]).max()
    assert values.shape == x.shape


def test_quantize_zero_and_errors():
    values, scales = quantize(np.zeros((2, 3)), "fp8_e4m3", "tensor")
    assert np.array_equal(values, np.zeros((2, 3))) and scales.ravel().tolist() == [1.0]
    assert np.array_equal(quantize(np.array([[0.3, 1.7]]), "bf16", "none")[0], fadev.round([[0.3, 1.7]], "bf16"))
    with pytest.raises(ValueError, match="scaling must be one of"):
        quantize(np.ones((2, 2)), scaling="row")
    with pytest.raises(ValueError, match="block must be a positive integer"):
        quantize(np.ones((2, 2)), scaling="block")
    with pytest.raises(ValueError, match="block is only used"):
        quantize(np.ones((2, 2)), scaling="tensor", block=2)
    with pytest.raises(ValueError, match=r"shape \(\.\.\., N, D\)"):
        quantize(np.ones(3))


# ------------------------------------------------------------------ experiment directions

def test_precision_flash_worse_than_baseline_and_shrinks_with_bits():
    df = precision.run(formats=("bf16", "fp16", "fp32"), N=4096, n_query=32, seeds=2).set_index("format")
    # flash under paper(bf16) deviates from golden several times more than baseline under naive(bf16)
    assert df.loc["bf16", "flash_vs_golden.rmse.mean"] > 2 * df.loc["bf16", "baseline_vs_golden.rmse.mean"]
    assert df.loc["bf16", "flash_vs_golden.max_abs.mean"] > df.loc["bf16", "baseline_vs_golden.max_abs.mean"]
    diff = df["flash_vs_baseline.max_abs.mean"]
    assert diff["bf16"] > 8 * diff["fp16"] > 64 * diff["fp32"]  # 3 and 13 more significand bits
    assert list(df["bits"]) == [8, 11, 24]
    found = precision.findings(df.reset_index())
    assert found[0].claim.startswith("flash vs golden at bf16") and found[1].holds
    # the headline ~10x claim does not hold at N = 4096: flash is about 3x the baseline's deviation there
    assert found[0].holds is False and 2 < df.loc["bf16", "ratio.rmse.mean"] < 5
    fp32 = next(f for f in found if f.claim == "at fp32")
    assert ("closer" in fp32.ours) == (df.loc["fp32", "flash_vs_golden.rmse.mean"] <
                                        df.loc["fp32", "baseline_vs_golden.rmse.mean"])


@pytest.mark.filterwarnings("error::RuntimeWarning")  # no 0 / 0 on the way
def test_precision_where_every_deviation_is_zero(tmp_path, capsys):
    """One key per query row: every output is v exactly, every deviation 0 (no positive value for the log
    axes): the report and both figures are still written."""
    from fadev.__main__ import main
    out = tmp_path / "zero"
    assert main(["precision", "--formats", "fp64,bf16", "--N", "1", "--n-query", "2", "--D", "2", "--block-q", "1",
                 "--block-kv", "1", "--seeds", "1", "--out", str(out), "--no-progress"]) == 0
    df = pd.read_csv(out / "precision.csv")
    assert (df["flash_vs_golden.rmse.mean"] == 0).all() and (df["baseline_vs_golden.rmse.mean"] == 0).all()
    assert (out / "precision.md").exists() and (out / "fig4_precision_vs_golden.png").stat().st_size > 0
    headline = [line for line in capsys.readouterr().out.splitlines() if line.startswith("- flash vs golden at bf16")]
    assert len(headline) == 1 and "n/a" in headline[0] and headline[0].endswith("(no verdict)")  # no ratio of 0s


def test_precision_headline_claim_at_quick_sizes():
    """Golden et al.'s ~10x at bf16, at the quick sizes (N = 16384, 64 rows, 3 seeds): it holds there."""
    sizes = {k: v for k, v in precision.SIZES["quick"].items() if k != "formats"}
    df = precision.run(formats=("bf16",), **sizes)
    found = precision.findings(df)[0]
    assert 5 <= df["ratio.rmse.mean"].iloc[0] <= 20 and found.holds is True and found.source == "golden"


def test_seqlen_flash_falls_behind_baseline_as_n_grows():
    df = seqlen.run(formats=("bf16",), Ns=(256, 2048, 16384), n_query=32, seeds=2)
    ratio = df["ratio.rmse.mean"].to_numpy()
    rel = df["flash_vs_baseline.rel_l2.mean"].to_numpy()
    assert list(df["N"]) == [256, 2048, 16384]
    assert np.all(ratio > 1) and np.all(np.diff(ratio) > 0) and ratio[-1] > 5
    assert np.all(np.diff(rel) > 0)
    assert df["flash_vs_baseline.max_abs.mean"].iloc[-1] > df["flash_vs_baseline.max_abs.mean"].iloc[1]
    ten = next(f for f in seqlen.findings(df) if "RMSE ratio" in f.claim)
    assert ten.holds and "holds for N >= 16384" in ten.ours and "at N = 2048" in ten.ours


def _flash(q, k, v, pol, **kw):
    return flash_attention(q, k, v, pol, **kw)


def test_block_q_and_loop_order_change_no_bit():
    q, k, v = random_qkv((1, 2, 96, 32), seed=4, fmt="bf16", seq_kv=300)
    for pol in (Policy.paper("bf16"), Policy.fa2("bf16")):
        ref = _flash(q, k, v, pol, block_q=64, block_kv=32)
        for bq in (1, 7, 32, 128):
            for order in ("q_outer", "kv_outer"):
                assert np.array_equal(_flash(q, k, v, pol, block_q=bq, block_kv=32, loop_order=order), ref)
    # ... unless the state differs from the running formats: FlashAttention-1 writes O and l in F
    fa1ish = Policy.fa2("bf16").replace(state="bf16")
    a = _flash(q, k, v, fa1ish, block_q=64, block_kv=32, loop_order="q_outer")
    b = _flash(q, k, v, fa1ish, block_q=64, block_kv=32, loop_order="kv_outer")
    assert np.array_equal(a, _flash(q, k, v, Policy.fa2("bf16"), block_q=64, block_kv=32))
    assert not np.array_equal(a, b)


def test_algorithm_directions():
    df = algorithm.run(N=4096, n_query=32, seeds=2)
    area = df[df["group"] == "tile area"]["flash_vs_golden.rmse.mean"].to_numpy()
    assert np.all(np.diff(area) < 0)  # larger block_kv, smaller deviation
    bq = df[df["group"] == "block_q"]
    assert (bq["same_as"].iloc[1:] == "64x64").all()
    assert bq["flash_vs_golden.rmse.mean"].nunique() == 1
    swap = df[df["group"] == "swap"].set_index("variant")["flash_vs_golden.rmse.mean"]
    assert swap["64x16 (swapped)"] > 1.5 * swap["16x64"] and swap["128x32 (swapped)"] > 1.5 * swap["32x128"]
    lo = df[df["group"] == "loop order"].set_index("variant")
    assert lo.loc["paper kv_outer", "same_as"] == "paper q_outer" and lo.loc["fa2 kv_outer", "same_as"] == "fa2 q_outer"
    assert lo.loc["fa2 kv_outer, state=bf16", "same_as"] == ""
    assert lo.loc["fa2 kv_outer, state=bf16", "flash_vs_golden.rmse.mean"] > \
        3 * lo.loc["fa2 q_outer", "flash_vs_golden.rmse.mean"]
    found = algorithm.findings(df)
    holds = {f.claim.split(" (")[0]: f.holds for f in found if f.holds is not None}
    assert all(holds.values()) and len(holds) == 4
    loop = next(f for f in found if f.claim.startswith("loop order"))
    assert "bit for bit under paper(bf16) and fa2(bf16)" in loop.ours and loop.source == "fadev"


def test_attribution_blames_the_running_statistics_at_bf16():
    df = attribution.run(formats=("bf16",), N=16384, n_query=32, seeds=1)  # l swamps at long N
    raise_ = df[(df["direction"] == "raise") & (df["stage"] != "none")].set_index("stage")
    assert "score_acc" not in raise_.index  # already fp32 in paper(bf16)
    assert raise_["share"].idxmax() == "stats" and raise_.loc["stats", "ratio"] < 0.8
    assert raise_.loc["p", "ratio"] == 1.0  # P is rounded to bf16 in both: raising it alone changes nothing
    lower = df[(df["direction"] == "lower") & (df["stage"] != "none")]
    assert (lower["ratio"] > 1).all() and abs(lower["share"].sum() - 1) < 1e-12


def test_kernels_emulation_columns_on_cpu():
    df = kernels.run(Ns=(256, 1024), n_query=16, seeds=1)
    assert set(df["impl"]) == {"emulated fa2", "emulated fa1", "emulated naive", "emulated torch_math",
                               "emulated " + kernels.PRESCALED}
    r = df[df["N"] == 1024].set_index(["format", "impl"])["vs_golden.rmse.mean"]
    for f in ("fp16", "bf16"):  # fp32 statistics and P.V accumulators beat the naive baseline
        assert r[(f, "emulated torch_math")] < r[(f, "emulated naive")]
        assert r[(f, "emulated fa2")] < r[(f, "emulated naive")] < r[(f, "emulated " + kernels.PRESCALED)]
    text = " ".join(f.ours for f in kernels.findings(df))
    assert "not measured" in text


def test_kernels_math_models_match_pytorch_on_cpu():
    """PyTorch's math SDPA on the CPU obeys allow_fp16_bf16_reduction_math_sdp as on the GPU: torch_math(F)
    models it without the flag, naive on q/k pre-scaled by sqrt(scale) with it, each to 1%; plain naive(F) is
    ~0.87x the reduced backend's error (docs/numerics.md)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    flag = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    for fmt, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        err = {"naive": [], "prescaled": [], "torch_math": [], "math": [], "math, reduced": []}
        for seed in range(3):
            q, k, v = common.inputs(2048, 32, 64, seed, fmt)
            ref = common.golden(2048, 32, 64, seed, fmt)
            err["naive"].append(compare(baseline_attention(q, k, v, Policy.naive(fmt)), ref).rmse)
            err["torch_math"].append(compare(baseline_attention(q, k, v, Policy.torch_math(fmt)), ref).rmse)
            err["prescaled"].append(compare(kernels.naive_prescaled(q, k, v, fmt), ref).rmse)
            tq, tk, tv = (torch.from_numpy(t.copy()).to(dtype) for t in (q, k, v))
            for name, reduced in (("math", False), ("math, reduced", True)):
                try:
                    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
                    with sdpa_kernel([SDPBackend.MATH]):
                        out = F.scaled_dot_product_attention(tq, tk, tv)
                finally:
                    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(flag)
                err[name].append(compare(out.double().numpy(), ref).rmse)
        m = {key: np.mean(val) for key, val in err.items()}
        assert kernels.within(m["prescaled"] / m["math, reduced"]) and kernels.within(m["torch_math"] / m["math"])
        assert m["prescaled"] / m["math, reduced"] == pytest.approx(1, abs=0.01), (fmt, m)
        assert m["torch_math"] / m["math"] == pytest.approx(1, abs=0.01), (fmt, m)
        assert 0.8 < m["naive"] / m["math, reduced"] < 0.92, (fmt, m)


@pytest.mark.gpu
@pytest.mark.skipif(not common.torch_cuda(), reason="PyTorch sees no CUDA device")
def test_kernels_torch_backends_match_their_emulations():
    """On a GPU: PyTorch's SDPA kernels next to the presets that model them, within the ±15% the presets
    claim (measured on an H200 before q/k pre-scaling was modelled: 0.86-1.06 at every N, plain naive vs
    math, reduced being the 0.86-0.87: docs/numerics.md)."""
    df = kernels.run(Ns=(4096,), n_query=64, seeds=2, device="cuda")
    r = df.set_index(["format", "impl"])["vs_golden.rmse.mean"]
    for f in ("fp16", "bf16"):
        assert r[(f, "torch math")] == pytest.approx(r[(f, "emulated torch_math")], rel=0.05)
        assert 0.85 < r[(f, "emulated fa2")] / r[(f, "torch flash")] < 1.15
        assert 0.85 < r[(f, "emulated " + kernels.PRESCALED)] / r[(f, "torch math, reduced")] < 1.15
    checks = [f for f in kernels.findings(df, device="cuda") if f.holds is not None]
    forward = [f for f in checks if not f.claim.startswith(("backward", "native tiles"))]
    tiles = [f for f in checks if f.claim.startswith("native tiles")]  # the tile sweep: fadev's own CUDA device
    assert len(tiles) == (4 if fadev.cuda_available() else 0)
    assert len(forward) == 2 * len(kernels.MODELS) and all(f.holds for f in checks), \
        [(f.claim, f.ours) for f in checks if not f.holds]


def test_fp8_hadamard_reduces_rmse_on_outliers():
    # the error is set by the few outlier entries that land in the sampled rows: per seed the rotation lowers
    # the RMSE to 0.2-0.9x (one seed in 24 measured above 1); over these three seeds to about 0.4x
    df = fp8.run(N=4096, n_query=64, seeds=3).set_index("variant")
    rm = df["vs_golden.rmse.mean"]
    assert rm["FA3 fp8 (block, Hadamard)"] < 0.8 * rm["FA3 fp8 (block)"]
    assert rm["FA3 fp8 (per-tensor, Hadamard)"] < 0.8 * rm["FA3 fp8 (per-tensor)"]
    assert rm["FA3 fp8 (block, Hadamard)"] < rm["baseline fp8 (per-tensor)"]
    assert rm["FA2 fp16"] < rm["baseline fp16"] < rm["FA3 fp8 (block, Hadamard)"]
    assert df.loc["baseline fp8 (per-tensor)", "fa3_reported"] == 2.4e-2


def test_results_are_resumable(tmp_path):
    kw = {"formats": ("bf16",), "N": 512, "n_query": 16, "seeds": 2}
    first = precision.run(out=str(tmp_path), **kw)
    lines = (tmp_path / "precision.jsonl").read_text().splitlines()
    again = precision.run(out=str(tmp_path), **kw)
    assert (tmp_path / "precision.jsonl").read_text().splitlines() == lines and len(lines) == 2
    assert first.equals(again)
    f1 = fp8.run(out=str(tmp_path), N=256, n_query=16, D=32, seeds=1)
    n = len((tmp_path / "fp8.jsonl").read_text().splitlines())
    assert fp8.run(out=str(tmp_path), N=256, n_query=16, D=32, seeds=1).equals(f1)
    assert len((tmp_path / "fp8.jsonl").read_text().splitlines()) == n == len(fp8.VARIANTS)


def test_size_overrides_are_checked():
    with pytest.raises(ValueError, match="unknown size parameter 'Nq'"):
        precision.run(Nq=3)
    with pytest.raises(ValueError, match="size must be 'quick' or 'full'"):
        precision.run("huge")
    with pytest.raises(ValueError, match="device must be"):
        common.sweep_device("tpu")
    assert common.sweep_device("cuda") in ("cpu", "cuda")


# ------------------------------------------------------------------ one experiment = one module

def test_every_experiment_has_the_same_interface():
    import inspect
    from fadev.experiments import EXPERIMENTS
    for name, mod in EXPERIMENTS.items():
        assert mod.NAME == name and mod.TITLE and mod.INTRO and mod.FIGURES and isinstance(mod.REPRODUCE, bool)
        assert {"quick", "full"} <= set(mod.SIZES) and set(mod.SIZE_DOCS) >= set(mod.SIZES["quick"]), name
        run = inspect.signature(mod.run).parameters
        assert list(run)[:2] == ["size", "out"], name
        for kw in ("device", "workers", "progress"):
            assert run[kw].kind is inspect.Parameter.KEYWORD_ONLY, (name, kw)
        found = inspect.signature(mod.findings).parameters
        assert list(found) == ["df", "device"] and found["device"].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert list(inspect.signature(mod.table).parameters) == ["df"], name
        assert list(inspect.signature(mod.figures).parameters) == ["df", "out_dir"], name


def test_report_renders_any_experiment(tmp_path):
    """fadev.report knows no experiment: it renders whatever it is given."""
    import types
    import pandas as pd
    from fadev import report
    from fadev.experiments import Finding
    df = pd.DataFrame({"x": [1, 2], "y.mean": [0.5, 0.25], "y.std": [0.1, 0.0]})
    exp = types.SimpleNamespace(TITLE="A made-up experiment", INTRO="What it does.", SIZES={"quick": {"n": 2}},
                                table=lambda d: report.table(d, [("x", "x", "d"), ("y", "y | mean", "pm")]))
    result = {"experiment": exp, "df": df, "figures": [str(tmp_path / "fig.png")], "seconds": 1.0,
              "findings": [Finding("a claim", "ours", "theirs", True, "golden"), Finding("a note", "text"),
                           Finding("a check", "ours", "", False, "fadev")]}
    path = report.write(str(tmp_path / "r.md"), {"madeup": result}, title="T", command="cmd --quick")
    text = open(path).read()
    assert text.startswith("# T\n") and "Regenerate with `cmd --quick`" in text
    assert "| madeup | a claim | ours | theirs | holds |" in text and "## 1. A made-up experiment" in text
    assert "### Claims of Golden et al. (arXiv 2405.02803): 1 of 1 hold" in text
    assert "### Claims of FlashAttention-3 (arXiv 2407.08608)\n\n(none measured in this run)" in text
    assert "| madeup | a check | ours |  | **does not hold** |" in text and ": 0 of 1 hold" in text
    findings = text.split("Findings:\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert findings == ["- a claim: ours; claimed: theirs — **holds**", "- a note: text — (no verdict)",
                        "- a check: ours — **does not hold**"]
    assert "What it does." in text and "Sizes (`quick`): n=2." in text and "![fig.png](fig.png)" in text
    assert "| y \\| mean |" in text and "| 1 | 5.000e-01 ± 1.0e-01 |" in text and "| 2 | 2.500e-01 |" in text
    import ast
    import os
    for module in ("report.py", "plots.py"):
        tree = ast.parse(open(os.path.join(os.path.dirname(fadev.__file__), module)).read())
        imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if "experiments" in m], module


def test_ring_experiment_tiny(tmp_path):
    df = ring.run("tiny", str(tmp_path))
    assert len(df) == len((tmp_path / "ring.jsonl").read_text().splitlines())
    assert set(df["merge"]) == {"lowp_partials", "fp32_partials", "lowp_running", "allgather"}
    zig = df[df["layout"] == "zigzag"]
    assert set(zig["W"]) == {1, 2, 4, 8} and set(df[df["layout"] == "contiguous"]["W"]) == {1, 2, 4, 8}
    assert (df[["out", "lse", "dq", "dk", "dv"]] > 0).all().all()  # bf16 runs always deviate from golden
    for c in df.attrs["candidates"]:
        assert c["factor"] == c["after"] / c["before"]
    again = ring.run("tiny", str(tmp_path))  # every sweep point is read back
    assert again.drop(columns="wall_s").equals(df.drop(columns="wall_s"))
    assert again.attrs["candidates"] == df.attrs["candidates"]
    text = ring.table(df)
    assert text.count("| normal |") == text.count("| outlier |") == 24 and "| rank | candidate |" in text
    assert len(ring.findings(df)) == 6
    assert ring.growth_per_doubling([1, 2, 4], [1.0, 2.0, 4.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="size must be 'tiny' or 'quick' or 'full'"):
        ring.run("huge")
