"""fadev.sweep: grid expansion, validation, evaluation against direct kernel calls, resumable results
files (a sweep really killed with SIGKILL, a truncated last line), parallel == serial, point_from_row
round trips, aggregate, and the ``python -m fadev sweep`` command line."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

import fadev
from fadev import sweep
from fadev.sweep import cli as sweep_cli
from helpers import kill_when

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {"N": 24, "D": 8, "heads": 2}
TIMING = ["wall_s", "test_s"]


def _env():
    """The environment for a child Python that must import this fadev (the CI's sanitizer build too)."""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(fadev.__file__))
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _values(df):
    """Rows by key without the timing columns, for comparing runs."""
    return df.drop(columns=TIMING).set_index("key").sort_index()


def _same(a, b):
    """Dicts equal value for value, NaN equal to NaN (exact otherwise)."""
    return a.keys() == b.keys() and all(a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]) for k in a)


def _read_lines(path):
    with open(path, "rb") as fh:
        return fh.read().split(b"\n")


# ------------------------------------------------------------------ expansion and validation

def test_expand_grid_points_and_base():
    pts = sweep.expand({"N": [16, 32], "seed": [0, 1, 2]}, base={"D": 8})
    assert pts == [{"D": 8, "N": n, "seed": s} for n in (16, 32) for s in (0, 1, 2)]
    pts = sweep.expand({"seed": [0, 1]}, [{"policy": "paper:bf16"}, {"policy": "fa2:fp16", "D": 16}], {"D": 8})
    assert pts == [{"D": 8, "policy": "paper:bf16", "seed": 0}, {"D": 8, "policy": "paper:bf16", "seed": 1},
                   {"D": 16, "policy": "fa2:fp16", "seed": 0}, {"D": 16, "policy": "fa2:fp16", "seed": 1}]
    assert sweep.expand(points=[{"N": 8}]) == [{"N": 8}]
    assert sweep.expand(base={"N": 8}) == [{"N": 8}]
    # TOML's dotted keys arrive nested: stage.p = [...] in [grid]
    assert sweep.expand({"stage": {"p": ["bf16", "fp32"]}}) == [{"stage.p": "bf16"}, {"stage.p": "fp32"}]
    with pytest.raises(ValueError, match=r"(?s)grid\['N'\] must be a list.*grid\['D'\] is empty"):
        sweep.expand({"N": 16, "D": []})
    with pytest.raises(ValueError, match="sets seed, which the grid also varies"):
        sweep.expand({"seed": [0, 1]}, [{"seed": 3}])
    with pytest.raises(ValueError, match="points is an empty list"):
        sweep.expand(points=[])
    with pytest.raises(ValueError, match="must be a dict"):
        sweep.expand(points=[3])


def test_canonical_forms_and_keys():
    p = sweep.canonical({"policy": "paper(bfloat16)", "override": {"p": "float32"}, "rounding": "nearest"})
    assert (p["policy"], p["stage.p"], p["rounding"]) == ("paper:bf16", "fp32", "rne")
    assert list(p)[:len(sweep.PARAMS)] == list(sweep.PARAMS)  # every parameter, in a fixed order
    assert sweep.canonical(p) == p
    assert sweep.point_key(p) == sweep.point_key({"stage.p": "fp32", "rounding": "rne"})
    assert sweep.point_key({"stage": {"p": "fp32"}}) == sweep.point_key({"stage.p": "fp32"})
    # parameters that do not apply are dropped, so equal runs share one key
    base = {"kernel": "baseline", "N": 32}
    assert sweep.point_key({**base, "block_kv": 16, "exp": "exp2"}) == sweep.point_key(base)
    assert sweep.point_key({"N": 32, "N_kv": 32, "heads": 2, "heads_kv": 2}) == sweep.point_key({"N": 32, "heads": 2})
    assert sweep.canonical({"rounding_seed": 5})["rounding_seed"] is None  # only stochastic rounding uses it
    assert sweep.canonical({"rounding": "sr", "rounding_seed": 5})["rounding_seed"] == 5
    assert sweep.canonical({"policy": fadev.Policy.fa2("fp16")})["policy"] == "fa2:fp16"
    assert sweep.point_key({"N": 32}) != sweep.point_key({"N": 32, "block_kv": 16})
    assert sweep.point_key({"tag.run": "a"}) != sweep.point_key({"tag.run": "b"})
    # defaults stay out of the hash: spelling a default out keeps the key
    assert sweep.point_key({}) == sweep.point_key(dict((k, v) for k, (v, _) in sweep.PARAMS.items()))


def test_validation_lists_every_problem_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep.schema, "cuda_available", lambda: False)  # the 'cuda' point's problem, on any machine
    points = [
        {"N": 16, "blok_kv": 8},                                          # unknown name, with a suggestion
        {"kernel": "flashy", "policy": "paper:bf17", "stage.pp": "fp32"},  # bad kernel, format, stage
        {"policy": "nonsense:bf16", "stage.p": "fp33", "D": 512},          # bad preset, format, D range
        {"block_kv": 0, "block_q": 2.5, "N": 0},                          # impossible tiles, N range
        {"sram_bytes": 4096, "block_kv": 64},                             # sram_bytes together with tiles
        {"heads": 3, "heads_kv": 2, "dist": "cauchy", "seed": -1},
        {"ref_policy": "naive:bf16", "ref_block_kv": 8, "ref_stage.p": "fp32"},  # ref settings, no ref_kernel
        {"golden": False},                                                # compares nothing
        {"device": "cuda", "causal": None, "policy": "golden:bf16"},
        {"override": "fp32", "tag.x": [1], "N": 16},
        {"N": 16},                                                        # a valid one among them
    ]
    out = tmp_path / "never.jsonl"
    with pytest.raises(ValueError) as info:
        sweep.run(points, out, progress=False)
    msg = str(info.value)
    assert not out.exists()
    assert msg.startswith("10 of 11 sweep points are invalid")
    for fragment in ["unknown parameter 'blok_kv' (did you mean 'block_kv'?)  [point 0]",
                     "kernel: must be one of 'flash', 'baseline', got 'flashy'",
                     "policy: unknown format 'bf17'", "stage.pp: unknown stage 'pp'", "stage.p: unknown format 'fp33'",
                     "unknown preset 'nonsense'", "D: must be in [1, 256], got 512",
                     "block_kv: must be in [1, 2147483647], got 0", "block_q: must be an integer, got 2.5",
                     "N: must be in [1, 1048576], got 0", "sram_bytes derives block_q and block_kv",
                     "heads_kv=2 must divide heads=3", "dist: must be one of 'normal', 'uniform', 'outlier'",
                     "seed: must be in [0, ", "ref_policy, ref_block_kv, ref_stage.p set but ref_kernel is None",
                     "golden is false and ref_kernel is None", "fadev.cuda_available() is False",
                     "causal: must not be None", "'golden' takes no format",
                     "override: must be a table", "tag.x: must be a printable string"]:
        assert fragment in msg, fragment
    # one problem shared by many grid points is listed once, with the points' indices
    with pytest.raises(ValueError) as info:
        sweep.validate(sweep.expand({"N": [8, 16, 32], "seed": [0, 1]}, base={"kernal": "flash"}))
    assert str(info.value).count("unknown parameter 'kernal'") == 1 and "[points 0-5]" in str(info.value)
    with pytest.raises(ValueError, match="a point must be a dict"):
        sweep.validate([["N", 16]])
    with pytest.raises(ValueError, match=r"stage.p: given twice"):
        sweep.canonical({"stage.p": "fp32", "override": {"p": "bf16"}})
    with pytest.raises(ValueError, match="tag.x: must be a printable string"):
        sweep.canonical({"tag.x": "two\nlines"})
    with pytest.raises(ValueError, match="a Policy object must be an unmodified preset"):
        sweep.canonical({"policy": fadev.Policy.fa2("fp16").replace(p="fp32")})
    with pytest.raises(ValueError, match="preset 'fa2' needs a format"):
        sweep.canonical({"policy": "fa2"})
    with pytest.raises(ValueError, match="custom format 'p5_e-6_7' cannot be named"):
        sweep.canonical({"stage.p": fadev.custom_format(5, -6, 7)})


def test_cuda_device_needs_cuda_kernels(monkeypatch):
    """With a usable GPU, a point still needs its kernel registered for device 'cuda'."""
    monkeypatch.setattr(sweep.schema, "cuda_available", lambda: True)  # where validation looks it up
    monkeypatch.delitem(sweep.KERNELS, ("flash", "cuda"))
    monkeypatch.delitem(sweep.KERNELS, ("baseline", "cuda"))
    with pytest.raises(ValueError, match="(?s)kernel='flash' has no CUDA implementation.*ref_kernel='baseline' has no"):
        sweep.validate([{"device": "cuda", "ref_kernel": "baseline"}])
    monkeypatch.setitem(sweep.KERNELS, ("flash", "cuda"), sweep.KERNELS[("flash", "cpu")])
    monkeypatch.setitem(sweep.KERNELS, ("baseline", "cuda"), sweep.KERNELS[("baseline", "cpu")])
    row = sweep.evaluate({"device": "cuda", "ref_kernel": "baseline", "golden": False, **TINY})
    assert row["device"] == "cuda" and row["vs_ref.n"] == 2 * 24 * 8


def test_cuda_kernels_are_registered():
    assert {("flash", "cuda"), ("baseline", "cuda")} <= set(sweep.KERNELS)


# ------------------------------------------------------------------ evaluation

def test_evaluate_equals_direct_calls():
    """The row's metrics are exactly fadev.compare of the documented runs on the documented inputs."""
    point = {"kernel": "flash", "policy": "paper:fp16", "stage.p": "fp32", "block_kv": 8, "loop_order": "kv_outer",
             "ref_kernel": "baseline", "ref_policy": "naive:bf16", "lse": True, "causal": True, "N": 24, "N_kv": 20,
             "D": 8, "heads": 4, "heads_kv": 2, "dist": "outlier", "seed": 3}
    row = sweep.evaluate(point)
    q, k, v = fadev.random_qkv((1, 4, 24, 8), dist="outlier", seed=3, fmt="fp16", heads_kv=2, seq_kv=20)
    pol = fadev.Policy.paper("fp16").replace(p="fp32")
    out, lse = fadev.flash_attention(q, k, v, pol, block_kv=8, loop_order="kv_outer", causal=True, return_lse=True)
    ref, ref_lse = fadev.baseline_attention(q, k, v, "naive:bf16", causal=True, return_lse=True)
    gold, gold_lse = fadev.baseline_attention(q, k, v, "golden", causal=True, return_lse=True)
    expected = {}
    for name, a, b in [("vs_golden", out, gold), ("vs_ref", out, ref), ("ref_vs_golden", ref, gold),
                       ("lse_vs_golden", lse, gold_lse), ("lse_vs_ref", lse, ref_lse),
                       ("lse_ref_vs_golden", ref_lse, gold_lse)]:
        expected.update({f"{name}.{m}": x for m, x in fadev.compare(a, b).as_dict().items()})
    assert _same({c: row[c] for c in expected}, expected)
    assert np.isnan(row["lse_vs_golden.mean_diff"])  # rows that see no key: lse = -inf on both sides
    assert row["vs_golden.max_abs"] > 0 and row["vs_golden.n"] == 4 * 24 * 8
    assert (row["policy_name"], row["ref_policy_name"]) == (pol.name, "naive(bf16)")
    assert (row["used.block_q"], row["used.block_kv"], row["used.loop_order"]) == (pol.block_q, 8, "kv_outer")
    assert row["ref_used.block_kv"] is None and row["key"] == sweep.point_key(point)
    assert sweep.point_from_row(row) == sweep.canonical(point)


def test_evaluate_inputs_sram_tiles_and_stochastic_rounding():
    # input_fmt="fp64": raw draws; the test policy rounds them itself, golden sees them unrounded
    row = sweep.evaluate({"kernel": "baseline", "policy": "naive:bf16", "input_fmt": "fp64", **TINY})
    q, k, v = fadev.random_qkv((1, 2, 24, 8))
    expected = fadev.compare(fadev.baseline_attention(q, k, v, "naive:bf16"), fadev.baseline_attention(q, k, v, "golden"))
    assert row["vs_golden.rmse"] == expected.rmse
    row = sweep.evaluate({"sram_bytes": 100, **TINY})  # Bc = ceil(100 / 32) = 4, Br = min(4, 8)
    assert (row["used.block_q"], row["used.block_kv"]) == (4, 4)
    # stochastic rounding is keyed by the point's seed unless rounding_seed is given
    a, b, c = (sweep.evaluate({"rounding": "stochastic", "seed": 1, **TINY, **extra})
               for extra in ({}, {"rounding_seed": 1}, {"rounding_seed": 2}))
    assert a["vs_golden.rmse"] == b["vs_golden.rmse"] != c["vs_golden.rmse"]
    assert a["key"] != b["key"]
    # a ref run without ref_policy uses the test run's whole policy: baseline vs flash under one policy
    row = sweep.evaluate({"ref_kernel": "baseline", "rounding": "stochastic", "stage.p": "fp32", **TINY})
    assert row["ref_policy_name"] == row["policy_name"] == "paper(bf16)+p=fp32,rounding=stochastic"


# ------------------------------------------------------------------ results files

def _resume_points(n):
    return sweep.expand({"seed": list(range(n))}, base={"N": 32, "D": 16, "heads": 2, "ref_kernel": "baseline"})


def test_resume_after_sigkill(tmp_path):
    n = 60
    out = tmp_path / "killed.jsonl"
    script = tmp_path / "child.py"
    # the child's flash kernel sleeps 10 ms per point (numerics untouched), and from the 25th point on
    # a minute, so that it is surely still running when it is killed
    script.write_text(textwrap.dedent(f"""
        import time
        import fadev.sweep as s
        real = s.KERNELS[("flash", "cpu")]
        calls = []
        def slow(*args):
            calls.append(1)
            time.sleep(0.01 if len(calls) < 25 else 60)
            return real(*args)
        s.KERNELS[("flash", "cpu")] = slow
        pts = s.expand({{"seed": list(range({n}))}}, base={{"N": 32, "D": 16, "heads": 2, "ref_kernel": "baseline"}})
        s.run(pts, {str(out)!r}, progress=False)
    """))
    child = subprocess.Popen([sys.executable, str(script)], env=_env(), cwd=str(tmp_path))
    kill_when(child, out, 10, timeout=60)
    lines = _read_lines(out)
    written = len([line for line in lines[:-1] if line])
    assert 10 <= written < 25
    resumed = sweep.run(_resume_points(n), out, progress=False)
    fresh = sweep.run(_resume_points(n), tmp_path / "fresh.jsonl", progress=False)
    on_disk = sweep.load(out)
    assert len(on_disk) == n and on_disk["key"].is_unique
    assert list(on_disk["key"][:written]) == [json.loads(x)["key"] for x in lines[:written]]  # old rows kept as is
    pd.testing.assert_frame_equal(_values(on_disk), _values(fresh))
    pd.testing.assert_frame_equal(_values(resumed), _values(fresh))
    assert list(resumed["key"]) == list(fresh["key"])  # rows come back in point order


def test_truncated_last_line_is_recomputed(tmp_path):
    pts = sweep.expand({"seed": [0, 1, 2, 3]}, base=TINY)
    out = tmp_path / "r.jsonl"
    full = sweep.run(pts, out, progress=False)
    data = out.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    out.write_bytes(data[:last + (len(data) - last) // 2])  # killed half-way through the last row
    assert len(sweep.load(out)) == 3  # load ignores the partial line
    again = sweep.run(pts, out, progress=False)
    assert out.read_bytes().endswith(b"\n") and len(_read_lines(out)) == 5
    pd.testing.assert_frame_equal(_values(sweep.load(out)), _values(full))
    pd.testing.assert_frame_equal(_values(again), _values(full))
    # a malformed line that ends with its newline is not a killed write: refuse to guess
    lines = out.read_bytes().split(b"\n")
    lines[1] = lines[1][:20]
    out.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        sweep.run(pts, out, progress=False)
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        sweep.load(out)
    out.write_bytes(b'{"N": 3}\n')
    with pytest.raises(ValueError, match="line 1 is not a sweep row"):
        sweep.load(out)
    out.write_bytes(b"\xff\xfe\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        sweep.run(pts, out, progress=False)


def test_truncated_csv_row_is_recomputed(tmp_path):
    pts = sweep.expand({"seed": [0, 1, 2]}, base=TINY)
    out = tmp_path / "r.csv"
    full = sweep.run(pts, out, progress=False)
    data = out.read_bytes()
    out.write_bytes(data[:-7])  # the last row lost its tail: fields may still parse, the newline is missing
    assert len(sweep.load(out)) == 2
    sweep.run(pts, out, progress=False)
    pd.testing.assert_frame_equal(_values(sweep.load(out)), _values(full))
    lines = out.read_bytes().split(b"\n")
    lines[2] = lines[2][:30]
    out.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=r"line 3 has \d+ fields, the header \d+"):
        sweep.load(out)
    out.write_bytes(b"a,b\n1,2\n")
    with pytest.raises(ValueError, match="no 'key' column"):
        sweep.run(pts, out, progress=False)


def test_failed_point_becomes_a_row_and_is_retried(tmp_path, monkeypatch):
    pts = sweep.expand({"seed": [0, 1, 2]}, base=TINY)
    real = sweep.KERNELS[("flash", "cpu")]

    def flaky(q, k, v, pol, causal, scale, tiles):
        if flaky.calls == 2:
            raise MemoryError("out of memory (simulated)")
        flaky.calls += 1
        return real(q, k, v, pol, causal, scale, tiles)
    flaky.calls = 0
    monkeypatch.setitem(sweep.KERNELS, ("flash", "cpu"), flaky)
    out = tmp_path / "r.jsonl"
    df = sweep.run(pts, out, progress=False)  # the failure does not stop the sweep
    assert list(df["error"].isna()) == [True, True, False]
    assert df["error"][2] == "MemoryError: out of memory (simulated)" and df["seed"][2] == 2
    assert np.isnan(df["vs_golden.rel_l2"][2]) and (df["vs_golden.rel_l2"][:2] > 0).all()
    assert len(sweep.load(out)) == 3
    monkeypatch.setitem(sweep.KERNELS, ("flash", "cpu"), real)
    again = sweep.run(pts, out, progress=False)  # the failed point runs again; its failed row is gone
    assert "error" not in again.columns and len(again) == 3
    on_disk = sweep.load(out)
    assert sorted(on_disk["key"]) == sorted(again["key"]) and "error" not in on_disk.columns
    pd.testing.assert_frame_equal(_values(again), _values(sweep.run(pts, progress=False)))


def test_executor_options_checked(monkeypatch):
    pts = sweep.expand(base=TINY)
    assert sweep_cli.cluster_option("local") == {"executor": "local"}
    for bad in ("dask", "ray=", "local=x"):
        with pytest.raises(Exception, match="expected local, ray or ray=ADDRESS"):
            sweep_cli.cluster_option(bad)
    with pytest.raises(ValueError, match="gpus_per_point must be a number > 0"):
        sweep.run(pts, executor="ray", gpus_per_point=0)
    with pytest.raises(ValueError, match="gpus_per_point applies to executor='ray' only"):
        sweep.run(pts, gpus_per_point=0.5)
    with pytest.raises(ValueError, match="address applies to executor='ray' only"):
        sweep.run(pts, address="auto")
    with pytest.raises(ValueError, match="executor must be 'local', 'ray' or a concurrent.futures.Executor"):
        sweep.run(pts, executor="dask")
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ImportError, match=r"needs Ray, which is not installed: pip install 'fadev\[ray\]'"):
        sweep.run(pts, executor="ray", progress=False)
    with pytest.raises(Exception, match=r"pip install 'fadev\[ray\]'"):
        sweep_cli.cluster_option("ray=auto")


def test_parallel_equals_serial(tmp_path):
    pts = sweep.expand({"policy": ["paper:bf16", "fa2:fp16"], "block_kv": [8, 16], "seed": [0, 1, 2]},
                       base={**TINY, "ref_kernel": "baseline", "lse": True})
    serial = sweep.run(pts, progress=False)
    parallel = sweep.run(pts, tmp_path / "p.jsonl", workers=2, progress=False)
    assert list(parallel["key"]) == list(serial["key"])
    pd.testing.assert_frame_equal(parallel.drop(columns=TIMING), serial.drop(columns=TIMING))
    pd.testing.assert_frame_equal(_values(sweep.load(tmp_path / "p.jsonl")), _values(serial))
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        sweep.run(pts, workers=0)


@pytest.mark.parametrize("ext", ["jsonl", "csv"])
def test_point_from_row_reproduces_metrics_exactly(tmp_path, ext):
    pts = [{"policy": "fa1:bf16", "sram_bytes": 512, "causal": True, "N_kv": 16, **TINY},
           {"kernel": "baseline", "policy": "torch_math:fp8_e4m3", "ref_kernel": "flash", "ref_block_kv": 4,
            "ref_exp": "exp2", "dist": "uniform", "scale": 0.3, "lse": True, **TINY},
           {"rounding": "stochastic", "rounding_seed": 9, "stage.score": "tf32", "tag.study": "x", "tag.rep": 2,
            "seed": 5, "heads_kv": 1, "input_fmt": "fp64", "golden": False, "ref_kernel": "baseline",
            "ref_policy": "golden", **TINY}]
    out = tmp_path / f"r.{ext}"
    sweep.run(pts, out, progress=False)
    df = sweep.load(out)
    assert len(df) == 3
    by_key = {sweep.point_key(p): p for p in pts}
    for _, row in df.iterrows():
        point = by_key[row["key"]]
        back = sweep.point_from_row(row)
        assert back == sweep.canonical(point)
        again = sweep.evaluate(back)
        metrics = [c for c in df.columns if "vs_" in c and pd.notna(row[c])]
        assert metrics and _same({c: again[c] for c in metrics}, {c: row[c] for c in metrics})
        assert {c for c in again if "vs_" in c} == set(metrics)
    assert "vs_golden.rmse" not in sweep.evaluate(pts[2])  # golden=False: no golden columns
    # a row whose parameters do not hash to its key is refused (types lost on the way)
    row = df.iloc[2].to_dict()
    row["tag.study"] = 1
    with pytest.raises(ValueError, match="does not match its parameters"):
        sweep.point_from_row(row)


def test_csv_file_widens_its_header(tmp_path):
    out = tmp_path / "r.csv"
    sweep.run([dict(TINY)], out, progress=False)
    sweep.run([{**TINY, "ref_kernel": "baseline", "stage.p": "fp32"}], out, progress=False)  # new columns
    df = sweep.load(out)
    assert len(df) == 2 and "vs_ref.max_abs" in df.columns and df["stage.p"].isna().tolist() == [True, False]
    assert sweep.run([dict(TINY)], out, progress=False)["key"].tolist() == [df["key"][0]]  # resumed, not rerun
    assert len(sweep.load(out)) == 2


def test_file_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown extension '.txt'"):
        sweep.run([TINY], tmp_path / "r.txt")
    with pytest.raises(ValueError, match="Parquet cannot be appended"):
        sweep.run([TINY], tmp_path / "r.parquet")
    out = tmp_path / "r.jsonl"
    sweep.run([TINY], out, progress=False)
    holder = sweep.ResultsFile(out)  # another sweep holds the file
    try:
        with pytest.raises(RuntimeError, match="locked by another running sweep"):
            sweep.run([TINY], out, progress=False)
    finally:
        holder.close()
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if pyarrow were not installed
    with pytest.raises(ImportError, match="pyarrow is not installed"):
        sweep.export(out, tmp_path / "r.parquet")
    for ext in ("csv", "jsonl"):
        sweep.export(out, tmp_path / f"copy.{ext}")
        pd.testing.assert_frame_equal(_values(sweep.load(tmp_path / f"copy.{ext}")), _values(sweep.load(out)))


# ------------------------------------------------------------------ aggregate

def test_aggregate_mean_std_count():
    df = sweep.run(sweep.expand({"kernel": ["flash", "baseline"], "seed": [0, 1, 2, 3]}, base=TINY), progress=False)
    agg = sweep.aggregate(df, by=["kernel"], metrics=["vs_golden.max_abs", "vs_golden.rmse"])
    assert list(agg["kernel"]) == ["flash", "baseline"] and list(agg["rows"]) == [4, 4]
    for kernel, group in df.groupby("kernel"):
        got = agg[agg["kernel"] == kernel].iloc[0]
        x = group["vs_golden.rmse"].to_numpy()
        assert got["vs_golden.rmse.mean"] == pytest.approx(x.mean(), rel=1e-15)
        assert got["vs_golden.rmse.std"] == pytest.approx(x.std(ddof=1), rel=1e-14)
        assert got["vs_golden.rmse.count"] == 4
    # defaults: every parameter except the seeds, every metric (block_kv is None for baseline: its own group)
    full = sweep.aggregate(df)
    assert len(full) == 2 and "seed" not in full.columns and "vs_golden.wasserstein.std" in full.columns
    assert full["block_kv"].isna().all()
    # a NaN run is not skipped: it makes its group's mean NaN and shows in count < rows
    df.loc[0, "vs_golden.rmse"] = np.nan
    agg = sweep.aggregate(df, by=["kernel"], metrics=["vs_golden.rmse"])
    assert np.isnan(agg["vs_golden.rmse.mean"][0]) and agg["vs_golden.rmse.count"][0] == 3
    assert not np.isnan(agg["vs_golden.rmse.mean"][1])
    whole = sweep.aggregate(df, by=[], metrics=["vs_golden.max_abs"])
    assert whole["rows"][0] == 8 and whole["vs_golden.max_abs.mean"][0] == pytest.approx(df["vs_golden.max_abs"].mean())
    with pytest.raises(ValueError, match="no column.*'vs_ref.rmse'"):
        sweep.aggregate(df, metrics=["vs_ref.rmse"])


def test_a_repeated_row_counts_once(tmp_path):
    """A key on several lines (a file appended to twice, files concatenated) is one row: the last, at its first
    place, as a rerun reads the file; aggregate counts it once."""
    df = sweep.run(sweep.expand({"seed": [0, 1]}, base=TINY), progress=False)
    out = tmp_path / "r.jsonl"
    sweep.export(df, out)
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines + lines[:1]))
    twice = sweep.load(out)
    assert list(twice["key"]) == list(df["key"])
    agg = sweep.aggregate(twice, by=["kernel"], metrics=["vs_golden.rmse"])
    assert list(agg["rows"]) == [2] and list(agg["vs_golden.rmse.count"]) == [2]
    assert agg["vs_golden.rmse.mean"][0] == df["vs_golden.rmse"].mean()


# ------------------------------------------------------------------ configs and the command line

def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fadev", *args], env=_env(), cwd=str(cwd), capture_output=True,
                          text=True, timeout=120)


def test_cli_sweep(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(textwrap.dedent("""
        [base]
        N = 16
        D = 8
        ref_kernel = "baseline"
        stage.p = "fp32"
        [grid]
        seed = [0, 1]
        [[points]]
        policy = "paper:bf16"
        [[points]]
        policy = "fa2:fp16"
        [points.override]
        out = "fp32"
    """))
    res = _cli("sweep", str(config), "--out", "r.jsonl", "--workers", "2", "--no-progress", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "4 rows in r.jsonl" in res.stdout
    df = sweep.load(tmp_path / "r.jsonl")
    assert len(df) == 4 and set(df["stage.p"]) == {"fp32"} and df["stage.out"].notna().sum() == 2
    direct = sweep.run(sweep_cli.load_config(config)[0], progress=False)
    # the file's columns come in the order its rows were written, which is the order the 2 workers finished in
    pd.testing.assert_frame_equal(_values(df), _values(direct), check_like=True)
    res = _cli("sweep", str(config), "--out", "r.jsonl", cwd=tmp_path)  # resumes: nothing left to do
    assert res.returncode == 0 and len(sweep.load(tmp_path / "r.jsonl")) == 4
    res = _cli("sweep", str(config), "--dry-run", cwd=tmp_path)
    assert res.returncode == 0 and "4 points (4 distinct), all valid; results would go to results/tiny.jsonl" in res.stdout
    config.write_text("[grid]\nN = [16, 0]\nblok_q = [8]\n")
    res = _cli("sweep", str(config), cwd=tmp_path)
    assert res.returncode == 2 and "N: must be in [1, 1048576], got 0" in res.stderr and "blok_q" in res.stderr
    assert not (tmp_path / "results").exists()
    config.write_text("[grids]\nN = [16]\n")
    res = _cli("sweep", str(config), cwd=tmp_path)
    assert res.returncode == 2 and "unknown top-level key(s) grids" in res.stderr
    res = _cli("sweep", "--help", cwd=tmp_path)
    assert res.returncode == 0
    for option in ("CONFIG.toml", "--out", "--workers", "--no-progress", "--dry-run"):
        assert option in res.stdout
    assert "sweep" in _cli("--help", cwd=tmp_path).stdout


def test_example_config_runs():
    points, options = sweep_cli.load_config(os.path.join(ROOT, "examples", "sweep_example.toml"))
    assert options == {"out": "results/sweep_example.jsonl", "workers": 1}
    df = sweep.run(points, progress=False)
    assert len(df) == 18 and set(df["tag.study"]) == {"example"}
    assert (df["vs_golden.max_abs"] > 0).all() and (df["ref_vs_golden.max_abs"] > 0).all()
