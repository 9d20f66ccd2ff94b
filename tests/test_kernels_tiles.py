"""The kernels experiment's native tile sweep (fadev/experiments/kernel_tiles.py).

Its verdicts both ways on synthetic tables (every tile within ±15% of its prediction and the trends agreeing;
a tile 30% off, trends that disagree); the whole sweep on the CPU with stand-ins for the native kernel (the
emulation itself, and the emulation's error times 1.3); table, figure and the recorded-folder rendering on
those rows; the CPU run of the experiment without the sweep. The sweep with the real native kernel runs where
fadev has a CUDA device."""
import os
import shutil

import numpy as np
import pandas as pd
import pytest

import fadev
from fadev.experiments import common, kernel_tiles, kernels, rerender
from helpers import needs_gpu

TILES = [(16, 16), (64, 16), (64, 64), (128, 64), (128, 128)]


# ------------------------------------------------------------------ stand-ins for the native kernel

def as_predicted(q, k, v, fmt, block_q, block_kv):
    """A native kernel with exactly the emulation's output."""
    return kernel_tiles.predict(q, k, v, fmt, block_q, block_kv)


def off_by_30(q, k, v, fmt, block_q, block_kv):
    """The emulation's error times 1.3 at tile 64x64, exactly the emulation's elsewhere."""
    out = kernel_tiles.predict(q, k, v, fmt, block_q, block_kv)
    if (block_q, block_kv) != (64, 64):
        return out
    ref = fadev.baseline_attention(q, k, v, fadev.Policy.golden())
    return ref + 1.3 * (out - ref)


def _tiles_df(native_factor=lambda bq, bkv, N: 1.0, emulated=lambda bq, bkv, N: 1e-3 / np.sqrt(N),
              Ns=(1024, 4096), tiles=TILES, formats=("fp16", "bf16")):
    """A synthetic sweep table: emulated RMSE ``emulated(bq, bkv, N)``; the native's that times native_factor."""
    rows = []
    for fmt in formats:
        for N in Ns:
            for bq, bkv in tiles:
                e = emulated(bq, bkv, N)
                for impl, value in ((kernel_tiles.NATIVE, e * native_factor(bq, bkv, N)), (kernel_tiles.EMULATED, e)):
                    rows.append({"impl": impl, "format": fmt, "N": N, "n_query": 128, "D": 64, "block_q": bq,
                                 "block_kv": bkv, "vs_golden.rmse.mean": value, "vs_golden.rmse.std": 0.02 * value,
                                 "vs_golden.max_abs.mean": 8 * value, "vs_golden.rel_l2.mean": 3 * value})
    return pd.DataFrame(rows)


def _verdicts(tf):
    return [(f.claim, f.holds) for f in kernel_tiles.findings(tf)]


# ------------------------------------------------------------------ verdicts

def test_verdicts_hold_within_15_percent_and_on_agreeing_trends():
    tf = _tiles_df(lambda bq, bkv, N: 1.1 if bkv == 64 else 0.9, emulated=lambda bq, bkv, N: 1e-3 * (1 + bkv / 256))
    found = kernel_tiles.findings(tf)
    assert [f.holds for f in found] == [True] * 4 and all(f.source == "fadev" for f in found)
    per_tile = [f for f in found if f.claim.endswith("per tile")]
    assert [f.claim.split(":")[0] for f in per_tile] == ["native tiles fp16", "native tiles bf16"]
    assert "all within ±15%" in per_tile[0].ours and "over 5 tiles x N = 1024..4096 (10 pairs)" in per_tile[0].ours
    assert "0.900x..1.100x" in per_tile[0].ours
    trend = [f for f in found if "smallest tile to the largest" in f.claim]
    # 128x128 / 16x16 at N = 4096: emulated (1 + 0.5) / (1 + 1/16), native with 0.9 at both ends
    assert all("RMSE 128x128 / 16x16: native 1.412x (grows), emulated 1.412x (grows); they agree" in f.ours
               for f in trend)


def test_verdicts_fail_for_a_tile_30_percent_off_and_for_opposite_trends():
    off = _tiles_df(lambda bq, bkv, N: 1.3 if (bq, bkv, N) == (64, 64, 4096) else 1.0)
    per_tile = {f.claim: f for f in kernel_tiles.findings(off) if f.claim.endswith("per tile")}
    assert [f.holds for f in per_tile.values()] == [False, False]
    assert all("outside ±15%: 1 of 10: 64x64 at N = 4096: 1.300x" in f.ours for f in per_tile.values())
    assert kernel_tiles.findings(_tiles_df(lambda bq, bkv, N: 1.149))[0].holds
    assert not kernel_tiles.findings(_tiles_df(lambda bq, bkv, N: 0.84))[0].holds
    # the native error shrinks 20% from the smallest tile to the largest where the emulation's grows 20%
    opposite = _tiles_df(lambda bq, bkv, N: 1.1 if (bq, bkv) == (16, 16) else 1.1 / 1.2 ** 2 if bq * bkv == 16384
                         else 1.0, emulated=lambda bq, bkv, N: 1e-3 * (1.2 if bq * bkv == 16384 else 1.0))
    trend = [f for f in kernel_tiles.findings(opposite) if "smallest tile to the largest" in f.claim]
    assert [f.holds for f in trend] == [False, False]
    assert "native 0.833x (shrinks), emulated 1.200x (grows); they disagree" in trend[0].ours
    # a trend at the flat band's edge on one side and just inside on the other is no disagreement
    edge = _tiles_df(lambda bq, bkv, N: 1.06 / 1.04 if bq * bkv == 16384 else 1.0,
                     emulated=lambda bq, bkv, N: 1e-3 * (1.04 if bq * bkv == 16384 else 1.0))
    t = kernel_tiles.trend(kernel_tiles.ratios(edge))[0]
    assert (t["native_direction"], t["emulated_direction"], t["agree"]) == ("grows", "flat", True)


def test_ratios_pair_tiles_and_skip_unpaired_rows():
    tf = _tiles_df(lambda bq, bkv, N: 1.25, tiles=[(128, 64), (16, 16), (64, 16)], Ns=(256,), formats=("bf16",))
    tf = tf[~((tf["impl"] == kernel_tiles.EMULATED) & (tf["block_q"] == 64))]  # 64x16: native only
    rt = kernel_tiles.ratios(tf)
    assert list(rt["tile"]) == ["16x16", "128x64"] and np.allclose(rt["ratio"], 1.25)
    assert kernel_tiles.tile_order([(64, 32), (32, 64), (16, 16), (128, 16)]) == [(16, 16), (128, 16), (64, 32),
                                                                                   (32, 64)]
    assert kernel_tiles.findings(tf.iloc[:0])[0].holds is None
    assert [kernel_tiles.direction(r) for r in (1.06, 0.94, 1.05, np.nan)] == ["grows", "shrinks", "flat", "n/a"]


def test_table_and_figure_on_synthetic_rows(tmp_path):
    tf = _tiles_df(lambda bq, bkv, N: 1.3 if (bq, bkv) == (64, 64) else 1.0)
    text = kernel_tiles.table(tf)
    lines = text.splitlines()
    assert lines[0] == ("| format | N | tile (block_q x block_kv) | fadev native RMSE | emulated fa2 RMSE | "
                        "native / emulated | within ±15% |")
    assert len(lines) == 2 + 2 * 2 * len(TILES)
    assert "| fp16 | 1024 | 64x64 | 4.063e-05 ± 8.1e-07 | 3.125e-05 ± 6.3e-07 | 1.300x | **no** |" in text
    assert text.count("| yes |") == 2 * 2 * (len(TILES) - 1)
    paths = kernel_tiles.figures(tf, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["kernels_tiles.png", "kernels_tiles.svg"]
    assert all(os.path.getsize(p) > 1000 for p in paths)


# ------------------------------------------------------------------ the sweep with a stand-in, on the CPU

def test_measure_takes_plain_arrays():
    q, k, v = common.inputs(512, 16, 64, 0, "bf16")
    ref = common.golden(512, 16, 64, 0, "bf16")
    emulated = kernel_tiles.measure(q, k, v, ref, "bf16", 64, 32, kernel_tiles.EMULATED)
    same = kernel_tiles.measure(q, k, v, ref, "bf16", 64, 32, kernel_tiles.NATIVE, native=as_predicted)
    assert same == emulated and set(emulated) == {f"vs_golden.{m}" for m in common.METRICS}
    off = kernel_tiles.measure(q, k, v, ref, "bf16", 64, 64, kernel_tiles.NATIVE, native=off_by_30)
    assert off["vs_golden.rmse"] == pytest.approx(1.3 * kernel_tiles.measure(q, k, v, ref, "bf16", 64, 64,
                                                                            kernel_tiles.EMULATED)["vs_golden.rmse"])
    with pytest.raises(ValueError, match="impl must be"):
        kernel_tiles.measure(q, k, v, ref, "bf16", 64, 32, "torch flash")
    with pytest.raises(ValueError, match="output shape"):
        kernel_tiles.measure(q, k, v, ref, "bf16", 64, 32, kernel_tiles.NATIVE, native=lambda *a: q[..., :8, :])


def test_sweep_runs_with_a_stand_in_native(tmp_path):
    params = {"formats": ("bf16", "fp16"), "Ns": (256, 1024), "n_query": 16, "D": 64, "seeds": 2}
    tiles = [(16, 16), (64, 64), (128, 64)]
    tf = kernel_tiles.run(params, str(tmp_path), native=as_predicted, tiles=tiles)
    assert len(tf) == 2 * 2 * 2 * len(tiles) and set(tf["n_query"]) == {128}  # a full query tile of 128 rows
    assert (tf["vs_golden.rmse.count"] == 2).all() and set(tf["impl"]) == set(kernel_tiles.IMPLS)
    found = kernel_tiles.findings(tf)
    assert [f.holds for f in found] == [True] * 4 and "1.000x..1.000x" in found[0].ours
    lines = (tmp_path / "kernels_tiles.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2 * 2 * len(tiles) and "test_kernels_tiles.as_predicted" in lines[0]
    assert pd.read_csv(tmp_path / "kernels_tiles.csv").shape[0] == len(tf)
    again = kernel_tiles.run(params, str(tmp_path), native=as_predicted, tiles=tiles)  # read back, not rerun
    assert (tmp_path / "kernels_tiles.jsonl").read_text().splitlines() == lines and again.equals(tf)
    off = kernel_tiles.run({**params, "Ns": (1024,), "seeds": 1}, None, native=off_by_30, tiles=tiles)
    per_tile = [f for f in kernel_tiles.findings(off) if f.claim.endswith("per tile")]
    assert not any(f.holds for f in per_tile) and all("64x64 at N = 1024: 1.300x" in f.ours for f in per_tile)
    with pytest.raises(ValueError, match="tiles: expected"):
        kernel_tiles.run(params, None, native=as_predicted, tiles=[])


def test_settings_cap_the_sequence_lengths():
    quick = kernel_tiles.settings(kernels.SIZES["quick"], "quick")
    assert quick["Ns"] == (256, 1024, 4096) and quick["formats"] == ("fp16", "bf16") and quick["D"] == 64
    assert kernel_tiles.settings(kernels.SIZES["full"], "full")["Ns"] == (256, 1024, 4096, 16384)
    assert kernel_tiles.settings({**kernels.SIZES["quick"], "Ns": (8192, 65536)}, "quick")["Ns"] == (8192,)


# ------------------------------------------------------------------ inside the kernels experiment

def test_cpu_run_has_no_sweep(tmp_path):
    df = kernels.run(Ns=(256,), n_query=16, seeds=1, formats=("bf16",), out=str(tmp_path))
    assert "tiles" not in df.attrs and not (tmp_path / "kernels_tiles.jsonl").exists()
    assert not any(f.claim.startswith("native tiles") for f in kernels.findings(df))
    assert "Native tile sweep" not in kernels.table(df)
    assert [os.path.basename(p) for p in kernels.figures(df, str(tmp_path))] == ["kernels.png", "kernels.svg"]
    if not fadev.cuda_available():  # asked for cuda without fadev's CUDA device: still no sweep, and said so
        assert "no native tile sweep" in kernels.ran_on("cuda")
        assert "tiles" not in kernels.run(Ns=(256,), n_query=16, seeds=1, formats=("bf16",), device="cuda").attrs


def test_kernels_report_carries_the_sweep(tmp_path):
    """With the sweep's rows in df.attrs: its verdicts among the findings (also beside the "not measured" note of
    a run without PyTorch's kernels), its table after the others, its figure after fig_kernels; and a recorded
    folder's kernels_tiles.csv is read back by `python -m fadev report DIR`."""
    tf = _tiles_df(lambda bq, bkv, N: 1.3 if (bq, bkv) == (64, 64) else 1.0)
    df = pd.DataFrame({"impl": ["emulated fa2"] * 2, "format": ["fp16", "bf16"], "N": [4096, 4096],
                       "vs_golden.rmse.mean": [1e-5, 1e-4]})
    df.attrs["tiles"] = tf
    claims = {f.claim: f.holds for f in kernels.findings(df, device="cuda") if f.claim.startswith("native tiles")}
    assert list(claims.values()) == [False, False, True, True]
    assert "Native tile sweep" in kernels.table(df) and "| 1.300x | **no** |" in kernels.table(df)
    names = [os.path.basename(p) for p in kernels.figures(df, str(tmp_path))]
    assert names == ["kernels.png", "kernels.svg", "kernels_tiles.png", "kernels_tiles.svg"]

    folder = tmp_path / "recorded"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "..", "docs", "results", "kernels-quick-h100-2026-11-22"),
                    folder)
    _, results = rerender.rerender(str(folder), out=str(tmp_path / "before.md"))
    assert "the native tile sweep" in (tmp_path / "before.md").read_text()  # a GPU run that predates it
    tf.to_csv(folder / "kernels_tiles.csv", index=False)
    shutil.copy(tmp_path / "kernels_tiles.png", folder / "kernels_tiles.png")
    _, results = rerender.rerender(str(folder), out=str(tmp_path / "after.md"))
    text = (tmp_path / "after.md").read_text()
    assert "the native tile sweep" not in text and "kernels_tiles.csv" in text
    assert "![kernels_tiles.png](recorded/kernels_tiles.png)" in text
    assert [f.holds for f in results["kernels"]["findings"] if f.claim.startswith("native tiles")] == \
        [False, False, True, True]


# ------------------------------------------------------------------ the real native kernel

@pytest.mark.gpu
@needs_gpu
def test_native_tiles_match_their_prediction_on_the_gpu():
    """Every forward tile at D 64 and N = 1024, 4096: the native kernel's RMSE within ±15% of fa2(F) emulated with
    its tiles, and the trend from the smallest tile to the largest the emulation's."""
    params = {"formats": ("fp16", "bf16"), "Ns": (1024, 4096), "n_query": 128, "D": 64, "seeds": 2}
    tf = kernel_tiles.run(params)
    assert set(zip(tf["block_q"], tf["block_kv"])) == set(fadev.native_tiles(64))
    found = kernel_tiles.findings(tf)
    assert len(found) == 4 and all(f.holds for f in found), [(f.claim, f.ours) for f in found if not f.holds]
