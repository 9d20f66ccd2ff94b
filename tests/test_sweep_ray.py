"""fadev.sweep on other executors: the same sweep through "local", Ray and a Dask LocalCluster gives the
same rows bit for bit; a point that raises on a Ray worker becomes a failed row and a rerun retries it;
a driver SIGKILLed mid-sweep, then rerun, leaves every point once in an intact file. One local Ray
instance (2 CPUs) serves the whole module; the children connect to it. Skipped without Ray/Dask."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

import fadev
from fadev import sweep

import helpers

ray = pytest.importorskip("ray")
if "libasan" in os.environ.get("LD_PRELOAD", ""):  # CI's sanitizer run: Ray's own raylet does not start
    pytest.skip("Ray's processes do not start with the sanitizers preloaded", allow_module_level=True)

TIMING = ["wall_s", "test_s"]
BASE = {"N": 24, "D": 8, "heads": 2, "ref_kernel": "baseline", "lse": True}


@pytest.fixture(scope="module")
def address():
    """A local Ray instance whose workers import this fadev and tests/helpers.py (PYTHONPATH, inherited by
    Ray's processes); its address, for child drivers."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _env():
    """The environment for a child Python (or Ray worker) that must import this fadev and tests/helpers.py."""
    env = dict(os.environ)
    paths = [os.path.dirname(os.path.dirname(fadev.__file__)), os.path.dirname(helpers.__file__)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    return env


def _values(df):
    return df.drop(columns=[c for c in TIMING if c in df.columns]).set_index("key").sort_index()


def _file_rows(path):
    """Every line of a results file parsed (none may be partial after a finished run)."""
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.decode().splitlines()]


def test_local_ray_and_dask_give_identical_rows(address, tmp_path):
    distributed = pytest.importorskip("distributed")
    pts = sweep.expand({"policy": ["paper:bf16", "fa2:fp16"], "block_kv": [8, 16], "seed": [0, 1]}, base=BASE)
    local = sweep.run(pts, tmp_path / "local.jsonl", progress=False)
    on_ray = sweep.run(pts, tmp_path / "ray.jsonl", executor="ray", workers=2, progress=False)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client:
        on_dask = sweep.run(pts, tmp_path / "dask.jsonl", executor=client.get_executor(), workers=2, progress=False)
    assert "error" not in local.columns and len(local) == len(pts)
    for other in (on_ray, on_dask):
        assert list(other["key"]) == list(local["key"])  # returned in the order of the points
        pd.testing.assert_frame_equal(other.drop(columns=TIMING), local.drop(columns=TIMING))
    # on disk, row by row: every value the same bits (JSON keeps float64 exactly), timings aside
    disk = {name: {r["key"]: {k: v for k, v in r.items() if k not in TIMING} for r in _file_rows(tmp_path / name)}
            for name in ("local.jsonl", "ray.jsonl", "dask.jsonl")}
    assert disk["ray.jsonl"] == disk["local.jsonl"] == disk["dask.jsonl"]
    # a rerun on Ray finds every point done: nothing appended
    before = (tmp_path / "ray.jsonl").read_bytes()
    again = sweep.run(pts, tmp_path / "ray.jsonl", executor="ray", progress=False)
    assert (tmp_path / "ray.jsonl").read_bytes() == before
    pd.testing.assert_frame_equal(_values(again), _values(local))


def test_failed_point_on_ray_is_a_row_then_retried(address, tmp_path):
    pts = {sweep.point_key(p): p for p in sweep.validate(sweep.expand({"seed": [0, 1, 2]}, base=BASE))}
    out = tmp_path / "r.jsonl"
    rows = sweep.drive(pts, helpers.evaluate_failing_seed_1, sweep.point_key, out, executor="ray", progress=False)
    errors = {r["seed"]: r.get("error") for r in rows.values()}
    assert errors == {0: None, 1: "ValueError: seed 1 fails (on purpose)", 2: None}
    assert len(_file_rows(out)) == 3
    rows = sweep.drive(pts, sweep.evaluate, sweep.point_key, out, executor="ray", progress=False)
    on_disk = _file_rows(out)
    assert sorted(r["key"] for r in on_disk) == sorted(pts) and all("error" not in r for r in on_disk)
    assert {k: r["vs_golden.rel_l2"] for k, r in rows.items()} == {r["key"]: r["vs_golden.rel_l2"] for r in on_disk}


def test_a_chunk_whose_worker_keeps_dying_becomes_failed_rows(address, tmp_path):
    """A point whose Ray worker process dies every time: Ray retries its task MAX_RETRIES times, then the
    point is a failed row naming Ray's error (not dropped), and the other points' rows are intact."""
    import faulty
    pts = {sweep.point_key(p): p for p in sweep.validate(sweep.expand({"seed": [0, 1]}, base=BASE))}
    dying = next(iter(pts))
    rows = sweep.drive({dying: pts[dying]}, faulty.dying_point, sweep.point_key, tmp_path / "r.jsonl",
                       executor="ray", workers=1, progress=False)
    assert list(rows) == [dying] and rows[dying]["error"].startswith("WorkerCrashedError: "), rows
    rows = sweep.drive(pts, sweep.evaluate, sweep.point_key, tmp_path / "r.jsonl", executor="ray", progress=False)
    assert sorted(rows) == sorted(pts) and all(r.get("error") is None for r in rows.values())


def test_workers_bounds_the_tasks_in_flight(address):
    """workers=1 on a 2-CPU Ray instance: one task at a time, so the points' time windows never overlap
    (with workers=2 they may); the share of the cluster a sweep was given, not all of it."""
    pts = {sweep.point_key(p): p for p in sweep.validate(sweep.expand({"seed": list(range(8))}, base=BASE))}
    rows = sweep.drive(pts, helpers.timed_point, sweep.point_key, None, executor="ray", workers=1, progress=False)
    spans = sorted((r["start"], r["end"]) for r in rows.values())
    assert len(spans) == 8 and all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_driver_killed_mid_sweep_then_rerun(address, tmp_path):
    n = 24
    pts = sweep.expand({"seed": list(range(n))}, base=BASE)
    out = tmp_path / "killed.jsonl"
    script = tmp_path / "driver.py"
    # the child drives the sweep on this module's Ray instance; each point sleeps SLOW_S first (numbers
    # untouched), so that it is surely still running when it is killed
    script.write_text(textwrap.dedent(f"""
        import helpers
        from fadev import sweep
        pts = sweep.validate(sweep.expand({{"seed": list(range({n}))}}, base={BASE!r}))
        sweep.drive({{sweep.point_key(p): p for p in pts}}, helpers.slow_evaluate, sweep.point_key, {str(out)!r},
                    executor="ray", address={address!r}, workers=2, progress=False)
    """))
    child = subprocess.Popen([sys.executable, str(script)], env=_env(), cwd=str(tmp_path))
    helpers.kill_when(child, out, 4)
    written = out.read_bytes().count(b"\n")
    assert 4 <= written < n
    df = sweep.run(pts, out, executor="ray", progress=False)
    on_disk = _file_rows(out)
    keys = [r["key"] for r in on_disk]
    assert len(keys) == len(set(keys)) == n and set(keys) == set(df["key"])  # nothing lost, nothing twice
    pd.testing.assert_frame_equal(_values(sweep.load(out)), _values(sweep.run(pts, progress=False)))


def test_cluster_option_names_an_address():
    from fadev.sweep.cli import cluster_option
    assert cluster_option("ray") == {"executor": "ray", "address": None}
    assert cluster_option("ray=auto") == {"executor": "ray", "address": "auto"}
    assert cluster_option("ray=ray://head:10001") == {"executor": "ray", "address": "ray://head:10001"}


def test_cli_sweep_and_train_drift_on_ray(address, tmp_path, capsys):
    from fadev.__main__ import main
    config = tmp_path / "tiny.toml"
    config.write_text('[base]\nN = 24\nD = 8\nheads = 2\n[grid]\nseed = [0, 1, 2]\n')
    assert main(["sweep", str(config), "--out", str(tmp_path / "local.jsonl"), "--no-progress"]) == 0
    assert main(["sweep", str(config), "--out", str(tmp_path / "ray.jsonl"), "--no-progress",
                 "--cluster", f"ray={address}"]) == 0
    assert "3 rows in" in capsys.readouterr().out
    pd.testing.assert_frame_equal(_values(sweep.load(tmp_path / "ray.jsonl")),
                                  _values(sweep.load(tmp_path / "local.jsonl")))


@pytest.mark.slow  # each Ray worker imports torch and scikit-learn first (~12 s on 2 busy cores)
def test_train_drift_runs_as_ray_tasks(address):
    """Each run a Ray task, compared at the logged steps: the lockstep rows (timings aside)."""
    pytest.importorskip("torch")
    from fadev import training
    runs = [training.RunSpec("base"), training.RunSpec("flash", "flash", "paper:bf16", tiling=(("block_q", 8),))]
    pairs = [training.Pair("flash", "flash", "base", "flash")]
    config = training.TrainConfig(width=16, heads=2, layers=1, batch=8, steps=3, log_every=2, eval_images=16)
    lockstep = training.track(config, runs, pairs)
    tasks = training.track_tasks(config, runs, pairs, executor="ray")
    for a, b in zip(tasks, lockstep):
        assert len(a) == len(b) > 0
        pd.testing.assert_frame_equal(a.drop(columns="seconds", errors="ignore"),
                                      b.drop(columns="seconds", errors="ignore"))
