"""Every verdict function on synthetic data where it must hold and where it must not: the report's counts
mean something only if each verdict can come out "does not hold". No kernel runs here (the kernels
verdicts need no GPU: synthetic tables of RMSE per implementation and N)."""
import numpy as np
import pandas as pd
import pytest

from fadev import report
from fadev.experiments import algorithm, common, fp8, kernels, precision, seqlen, train_drift
from fadev.experiments.common import Finding


# ------------------------------------------------------------------ range verdicts

@pytest.mark.parametrize("ok, text", [
    ([True, True, True], "holds at every N = 256..4096"),
    ([False, False, False], "does not hold at any N = 256..4096 (3x at N = 4096)"),
    ([False, True, True], "holds for N >= 1024; 1x at N = 256"),
    ([True, True, False], "holds for N <= 1024; 3x at N = 4096"),
    ([True, False, True], "holds at N = 256, 4096; 2x at N = 1024"),
    ([False, True, False], "holds at N = 1024 only; 1x at N = 256, 3x at N = 4096"),
])
def test_where_holds(ok, text):
    assert common.where_holds([256, 1024, 4096], ok, [1.0, 2.0, 3.0]) == text
    assert common.where_holds([1, 2, 4, 8], [False, True, True, False], [1.0, 2.0, 3.0, 4.0]) == \
        "holds for 2 <= N <= 4; 1x at N = 1, 4x at N = 8"


def test_where_holds_errors():
    with pytest.raises(ValueError, match="same non-zero length"):
        common.where_holds([1, 2], [True], [1.0, 2.0])
    with pytest.raises(ValueError, match="a verdict needs source"):
        Finding("c", "o", "p", True)
    assert Finding("c", "o").holds is None  # a note needs no source


def test_counts_per_source():
    found = [Finding("a", "", "", True, "golden"), Finding("b", "", "", False, "golden"),
             Finding("c", "", "", True, "fadev"), Finding("note", ""),
             Finding("d", "", "", False, "golden", partly="for N >= 2048")]
    assert report.counts(found) == {"golden": (1, 1, 3), "fa3": (0, 0, 0), "fadev": (1, 0, 1)}
    assert report.count_line(found) == "Golden et al.: 1 of 3 hold, 1 partly; fadev's checks: 1 of 1 hold"
    assert report.count_line([Finding("note", "")]) == "no claim with a verdict in this run"
    lines = report.summary({"x": {"findings": found}})
    assert "### Claims of Golden et al. (arXiv 2405.02803): 1 of 3 hold, 1 partly" in lines
    assert "### Claims of FlashAttention-3 (arXiv 2407.08608)" in lines  # no "0 of 0" where nothing was judged
    assert "| x | d |  |  | **partly holds (for N >= 2048)** |" in lines


def test_partly_verdict():
    f = Finding("c", "o", "p", False, "golden", partly="for N >= 2048")
    assert f.verdict == "partly holds (for N >= 2048)" and not f.holds
    assert f.markdown() == "- c: o; claimed: p — **partly holds (for N >= 2048)**"
    assert Finding("c", "o", "p", False, "golden").verdict == "does not hold"
    for holds in (True, None):  # "partly" only where the claim does not hold on the whole range
        with pytest.raises(ValueError, match="partly='x' needs holds=False"):
            Finding("c", "o", "p", holds, "golden", partly="x")


@pytest.mark.parametrize("ok, text", [
    ([True, True, True, True], "at every N"), ([False] * 4, "nowhere"), ([False, True, True, True], "for N >= 2"),
    ([True, True, False, False], "for N <= 2"), ([False, True, True, False], "for 2 <= N <= 4"),
    ([False, True, False, False], "at N = 2 only"), ([True, False, True, False], "at N = 1, 4"),
])
def test_holds_range(ok, text):
    assert common.holds_range([1, 2, 4, 8], ok) == text


# ------------------------------------------------------------------ Golden et al.

def _precision_df(ratio_bf16, fb):
    fmts = list(fb)
    return pd.DataFrame({
        "format": fmts, "N": 16384, "D": 64, "block_q": 64, "block_kv": 64,
        "ratio.rmse.mean": [ratio_bf16 if f == "bf16" else 1.0 for f in fmts], "ratio.rmse.std": 0.5,
        "ratio.rmse.count": 3, "ratio.max_abs.mean": 2.0, "flash_vs_golden.max_abs.mean": 1e-3,
        "baseline_vs_golden.max_abs.mean": 5e-4, "flash_vs_baseline.max_abs.mean": list(fb.values()),
        "flash_vs_golden.rmse.mean": [2e-7 if f == "fp32" else 1e-4 for f in fmts],
        "baseline_vs_golden.rmse.mean": [4e-7 if f == "fp32" else 1e-5 for f in fmts]})


@pytest.mark.parametrize("ratio, fb, ten, shrink", [
    (10.0, {"bf16": 5e-3, "fp16": 3e-4, "fp32": 3e-7}, True, True),
    (3.0, {"bf16": 5e-3, "fp16": 3e-4, "fp32": 3e-7}, False, True),    # ~3x at N = 4096: not ~10x
    (40.0, {"bf16": 5e-3, "fp16": 6e-3, "fp32": 3e-7}, False, False),  # too far; fp16 above bf16
])
def test_precision_verdicts(ratio, fb, ten, shrink):
    found = precision.findings(_precision_df(ratio, fb))
    assert (found[0].holds, found[1].holds) == (ten, shrink)
    assert found[0].source == found[1].source == "golden"
    assert "2x closer" in next(f for f in found if f.claim == "at fp32").ours


@pytest.mark.parametrize("fb", [{"bf16": 5e-3}, {"fp16": 3e-4, "tf32": 1e-3}, {"fp64": 0.0}])
def test_precision_shrinks_has_no_verdict_with_one_precision(fb):
    """One significand width (tf32 and fp16 share p = 11; fp64 is left out): nothing to shrink across."""
    found = precision.findings(_precision_df(10.0, fb))
    shrink = [f for f in found if f.claim.startswith("flash vs baseline difference shrinks")]
    assert len(shrink) == 1 and shrink[0].holds is None


def _seqlen_df(Ns, mx, ratio):
    n = len(Ns)
    return pd.DataFrame({
        "format": "bf16", "N": Ns, "block_q": 64, "block_kv": 64, "flash_vs_baseline.max_abs.mean": mx,
        "flash_vs_baseline.std_diff.mean": mx, "flash_vs_baseline.mean_diff.mean": np.zeros(n),
        "flash_vs_baseline.rel_l2.mean": np.linspace(1e-3, 1e-2, n), "ratio.rmse.mean": ratio})


def test_seqlen_verdicts_both_ways():
    """Each of the three bf16 verdicts (max and std of flash - baseline grow with N; ~10x reached at long N)
    holds, partly holds (with the range) and does not hold on data made for each."""
    Ns = [1024, 4096, 8192, 16384]
    good = seqlen.findings(_seqlen_df(Ns, [2e-3, 2.5e-3, 4e-3, 8e-3], [1.9, 3.0, 6.0, 12.0]))
    assert [f.holds for f in good if f.holds is not None] == [True, True, True]
    assert "it rises throughout" in good[0].ours and "it rises throughout" in good[2].ours
    assert good[3].ours.endswith("holds for N >= 8192; 3x at N = 4096")
    # the values first fall clearly (4e-3 at N = 1024, 2x the minimum): "grows" holds from the minimum on
    part = seqlen.findings(_seqlen_df(Ns, [4e-3, 2e-3, 3e-3, 8e-3], [1.9, 8.0, 30.0, 60.0]))
    assert [f.verdict for f in part if f.holds is not None] == ["partly holds (for N >= 4096)"] * 2 + \
        ["partly holds (at N = 4096 only)"]
    assert "it falls, then rises" in part[0].ours
    assert part[3].ours.endswith("holds at N = 4096 only; 1.9x at N = 1024, 30x at N = 8192")
    # a dip within the seeds' noise (1.2x the minimum) is no fall: holds throughout
    assert seqlen.findings(_seqlen_df(Ns, [2.4e-3, 2e-3, 3e-3, 8e-3], [1.9, 3.0, 6.0, 12.0]))[0].holds is True
    bad = seqlen.findings(_seqlen_df(Ns, [4e-3, 3e-3, 2e-3, 1e-3], [1.9, 2.0, 2.5, 3.0]))
    assert [(f.holds, f.partly) for f in bad if f.holds is not None] == [(False, "")] * 3
    assert "it falls throughout" in bad[0].ours and "does not hold at any N = 1024..16384 (3x at N = 16384)" \
        in bad[3].ours
    assert seqlen.shape([1, 2, 1]) == "rises, then falls" and seqlen.shape([1, 2, 1, 2]) == "goes up and down"
    assert seqlen.shape([2, 2]) == "is flat"


def _algorithm_df(area, swapped, block_q_same, loop_same, state_same):
    rows = []
    for i, r in enumerate(area):
        rows.append(("tile area", f"{16 << i}x{16 << i}", "paper:bf16", r, ""))
    rows += [("swap", "16x64", "paper:bf16", 1e-3, ""), ("swap", "64x16 (swapped)", "paper:bf16", swapped, "")]
    rows += [("block_q", "64x64", "paper:bf16", 1e-3, ""),
             ("block_q", "16x64", "paper:bf16", 1e-3 if block_q_same else 2e-3, "64x64" if block_q_same else "")]
    for pol in ("paper", "fa2"):
        rows += [("loop order", f"{pol} q_outer", f"{pol}:fp16", 1e-4, ""),
                 ("loop order", f"{pol} kv_outer", f"{pol}:fp16", 1e-4, f"{pol} q_outer" if loop_same else "")]
    rows.append(("loop order", "fa2 kv_outer, state=fp16", "fa2:fp16", 1e-3, "fa2 q_outer" if state_same else ""))
    return pd.DataFrame(rows, columns=["group", "variant", "policy", "flash_vs_golden.rmse.mean", "same_as"]).assign(
        **{"flash_vs_baseline.max_abs.mean": 1e-3})


def test_algorithm_verdicts_both_ways():
    good = algorithm.findings(_algorithm_df([4e-3, 2e-3, 1e-3], 5e-3, True, True, False))
    assert [f.holds for f in good if f.holds is not None] == [True, True, True, True]
    loop = next(f for f in good if f.claim.startswith("loop order"))
    assert "bit for bit under paper(fp16) and fa2(fp16)" in loop.ours and loop.source == "fadev"
    bad = algorithm.findings(_algorithm_df([4e-3, 5e-3, 1e-3], 5e-4, False, False, True))
    assert [f.holds for f in bad if f.holds is not None] == [False, False, False, False]
    loop = next(f for f in bad if f.claim.startswith("loop order"))
    assert "bit for bit" not in loop.ours and "differs from q_outer under paper(fp16) and fa2(fp16)" in loop.ours
    assert "NOT identical" in next(f for f in bad if f.claim.startswith("square")).ours


# ------------------------------------------------------------------ FlashAttention-3

def _fp8_df(rm, std=1e-4):
    return pd.DataFrame({"variant": list(rm), "vs_golden.rmse.mean": list(rm.values()), "vs_golden.rmse.std": std})


def test_fp8_verdicts_both_ways():
    good = {"baseline fp16": 3e-4, "FA2 fp16": 2e-4, "FA3 fp16": 2e-4, "baseline fp8 (per-tensor)": 2e-2,
            "FA3 fp8 (per-tensor)": 2e-2, "FA3 fp8 (per-tensor, Hadamard)": 1e-2, "FA3 fp8 (block)": 2.01e-2,
            "FA3 fp8 (block, Hadamard)": 9e-3}
    found = fp8.findings(_fp8_df(good))
    assert [f.holds for f in found if f.holds is not None] == [True] * 4
    assert all(f.source == "fa3" for f in found if f.holds is not None)
    assert "within the seeds' spread" in found[-1].ours
    bad = {**good, "FA2 fp16": 4e-4, "FA3 fp8 (per-tensor, Hadamard)": 3e-2, "FA3 fp8 (block)": 1e-2,
           "FA3 fp8 (block, Hadamard)": 3e-2}
    found = fp8.findings(_fp8_df(bad))
    assert [f.holds for f in found if f.holds is not None] == [False] * 4
    assert "lower by more than the seeds' spread (0.5x)" in found[-1].ours


# ------------------------------------------------------------------ fadev: emulation vs real kernels

def _kernels_df(ratio_at):
    """Synthetic kernels table: every real kernel's RMSE 1e-4 / sqrt(N); its emulation's ratio_at(N) times it."""
    rows = []
    for fmt in ("fp16", "bf16"):
        for N in (1024, 4096, 65536):
            for real, model in kernels.MODELS.items():
                rows.append((real, fmt, N, 1e-4 / np.sqrt(N)))
            for model in set(kernels.MODELS.values()):
                rows.append((f"emulated {model}", fmt, N, ratio_at(N) * 1e-4 / np.sqrt(N)))
    return pd.DataFrame(rows, columns=["impl", "format", "N", "vs_golden.rmse.mean"])


def test_kernels_verdicts_both_ways():
    good = [f for f in kernels.findings(_kernels_df(lambda N: 1.1)) if f.holds is not None]
    assert len(good) == 2 * len(kernels.MODELS) and all(f.holds for f in good)
    assert all(f.source == "fadev" and "holds at every N = 1024..65536" in f.ours for f in good)
    partial = [f for f in kernels.findings(_kernels_df(lambda N: 0.8 if N == 65536 else 0.9)) if f.holds is not None]
    assert not any(f.holds for f in partial) and all(f.verdict == "partly holds (for N <= 4096)" for f in partial)
    assert all("holds for N <= 4096; 0.8x at N = 65536" in f.ours for f in partial)
    bad = [f for f in kernels.findings(_kernels_df(lambda N: 1.2)) if f.holds is not None]
    assert bad and all(f.verdict == "does not hold" for f in bad)
    assert kernels.within(0.851) and kernels.within(1.149) and not kernels.within(0.84) and not kernels.within(1.16)
    only_emulated = _kernels_df(lambda N: 1.0)
    only_emulated = only_emulated[only_emulated["impl"].str.startswith("emulated")]
    assert all(f.holds is None for f in kernels.findings(only_emulated))


def test_ran_on_says_where():
    assert common.ran_on("cpu") == "the CPU"
    if common.sweep_device("cuda") == "cpu":
        assert common.ran_on("cuda").startswith("the CPU (asked for `--device cuda`")
    assert "not run" in kernels.ran_on("cpu") and fp8.ran_on("cuda").startswith("the CPU")


def _drift_df(ratio):
    """Synthetic drift table: the precision pair drifts 1e-2 * step, init 2e-2 * step, flash ratio x precision."""
    rows = []
    for step in (0, 50, 100):
        for pair, role, d in (("bf16 vs fp32", "precision", 1e-2), ("seed 0 vs 1", "init", 2e-2),
                              ("flash vs baseline", "flash", ratio * 1e-2), ("same vs same", "control", 0.0)):
            rows.append((pair, role, step, d * step, d * step))
    return pd.DataFrame(rows, columns=["pair", "role", "step", "max_abs", "wasserstein"])


@pytest.mark.parametrize("ratio, holds", [(0.3, True), (0.9, False), (0.05, False)])
def test_train_drift_verdicts_both_ways(ratio, holds):
    found = train_drift.findings(_drift_df(ratio))
    checks = [f for f in found if f.holds is not None]
    assert len(checks) == 2 and all(f.holds is holds and f.source == "golden" for f in checks)
    assert f"{ratio:.3g} ({ratio:.3g} at step 100)" in checks[0].ours
    assert ("holds for all" if holds else "holds for none") in found[2].ours
    assert "exactly 0 at every logged step" in found[3].ours
