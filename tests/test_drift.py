"""fadev.training: the zero-drift control (identical runs hold bit-identical weights at every step), the
attention policy really changing training, resume after a real SIGKILL without lost or duplicated rows,
extension of a finished run, argument errors, and the ``python -m fadev train-drift`` command line."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import fadev
from fadev.__main__ import main
from fadev.sweep.results import load
from fadev.training import Pair, RunSpec, TrainConfig, config_key, track
from fadev.training import digits
from fadev.experiments.train_drift import check_device, ratios, runs_and_pairs

TINY = TrainConfig(width=16, heads=2, layers=1, batch=8, steps=6, log_every=2, eval_images=16)
TILES = {"block_q": 8, "block_kv": 8}
TIMING = ["seconds"]
BASE = RunSpec("base", "baseline", "naive:bf16", "bf16")
FLASH = RunSpec("flash", "flash", "paper:bf16", "bf16", tiling=TILES)
SMALL_CLI = ["--width", "16", "--heads", "2", "--layers", "1", "--batch", "8", "--eval-images", "16"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(fadev.__file__)) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _values(df):
    return df.drop(columns=TIMING, errors="ignore").set_index("key").sort_index()


def test_control_runs_are_bit_identical_at_every_step():
    config = TrainConfig(width=16, heads=2, layers=1, batch=8, steps=5, log_every=1, eval_images=16)
    seen = []

    def check(step, models):
        a, b = models["flash"].state_dict(), models["flash_copy"].state_dict()
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == torch.float32 for k in a), step
        seen.append(step)

    runs = [FLASH, RunSpec("flash_copy", "flash", "paper:bf16", "bf16", tiling=TILES)]
    drift, loss = track(config, runs, [Pair("control", "flash_copy", "flash", "control")], callback=check)
    assert seen == [0, 1, 2, 3, 4, 5]
    assert list(drift["step"]) == seen
    assert (drift[["max_abs", "wasserstein", "rmse", "rel_l2"]].to_numpy() == 0).all()
    by_run = loss.set_index(["run", "step"])
    assert all(by_run.loc[("flash", s), "eval_loss"] == by_run.loc[("flash_copy", s), "eval_loss"] for s in seen)


@pytest.mark.gpu
@pytest.mark.skipif(not (fadev.cuda_available() and torch.cuda.is_available()), reason="needs a CUDA device and torch")
def test_control_runs_are_bit_identical_on_the_gpu():
    """On the GPU too (models on the device, attention through fadev's GPU kernels): identical runs stay identical."""
    check_device("cuda")
    config = TrainConfig(width=16, heads=2, layers=1, batch=8, steps=3, log_every=1, eval_images=16)
    runs = [FLASH, RunSpec("flash_copy", "flash", "paper:bf16", "bf16", tiling=TILES), BASE]
    drift, _ = track(config, runs, [Pair("control", "flash_copy", "flash", "control"),
                                    Pair("flash", "flash", "base", "flash")], device="cuda")
    control = drift[drift["pair"] == "control"]
    assert (control[["max_abs", "wasserstein", "rmse", "rel_l2"]].to_numpy() == 0).all()
    assert (drift[(drift["pair"] == "flash") & (drift["step"] > 0)]["max_abs"] > 0).all()


def test_attention_policy_and_precision_change_training():
    runs = [BASE, FLASH, RunSpec("fp32", "baseline", "golden", "fp32"), RunSpec("seed1", init_seed=1)]
    pairs = [Pair("flash", "flash", "base", "flash"), Pair("prec", "base", "fp32", "precision"),
             Pair("init", "seed1", "base", "init")]
    drift, loss = track(TINY, runs, pairs)
    d = drift.set_index(["pair", "step"])
    for p in ("flash", "prec"):
        assert d.loc[(p, 0), "max_abs"] == 0  # same init
        assert all(d.loc[(p, s), "max_abs"] > 0 and d.loc[(p, s), "wasserstein"] > 0 for s in (2, 4, 6))
    assert d.loc[("init", 0), "max_abs"] > 0
    assert loss[loss["step"] == 6]["eval_loss"].lt(loss[loss["step"] == 0]["eval_loss"].max()).all()  # it learns
    r = ratios(drift, "max_abs")["flash"]
    assert r["precision"][2] == "prec" and r["init"][2] == "init" and r["precision"][0] > 0


def test_mixed_precision_rounds_matmul_operands():
    torch.manual_seed(0)
    lin = digits.Linear(8, 4)
    lin.low = torch.bfloat16
    x = torch.randn(3, 8, requires_grad=True)
    y = lin(x)
    assert torch.equal(y, y.bfloat16().float())
    ref = torch.nn.functional.linear(x.bfloat16().float(), lin.weight.bfloat16().float(), lin.bias.bfloat16().float())
    assert torch.equal(y, ref.bfloat16().float())
    y.sum().backward()
    assert torch.equal(lin.weight.grad, lin.weight.grad.bfloat16().float())
    assert torch.equal(x.grad, x.grad.bfloat16().float())


def test_batches_are_a_function_of_the_step():
    a = digits.batch_indices(46, 32, 1500, 0)  # positions 1472..1503 cross into epoch 1
    perm0, perm1 = (np.random.default_rng([0, e]).permutation(1500) for e in (0, 1))
    assert (a[:28] == perm0[1472:]).all() and (a[28:] == perm1[:4]).all()
    assert (a == digits.batch_indices(46, 32, 1500, 0)).all()
    assert not (a == digits.batch_indices(46, 32, 1500, 1)).all()
    first = [digits.batch_indices(s, 30, 1500, 0) for s in range(50)]
    assert sorted(int(i) for b in first for i in b) == list(range(1500))  # one epoch = a permutation


_CHILD = textwrap.dedent("""
    import sys
    from fadev.training import Pair, RunSpec, TrainConfig, track
    config = TrainConfig(width=16, heads=2, layers=1, batch=8, steps=int(sys.argv[2]), log_every=2, eval_images=16)
    runs = [RunSpec("base"), RunSpec("flash", "flash", "paper:bf16", tiling={"block_q": 8, "block_kv": 8})]
    track(config, runs, [Pair("flash", "flash", "base", "flash")], out=sys.argv[1])
""")


def _child(out, steps):
    return subprocess.Popen([sys.executable, "-c", _CHILD, out, str(steps)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _lines(path):
    try:
        with open(path, "rb") as fh:
            return fh.read().count(b"\n")
    except FileNotFoundError:
        return 0


def test_resume_after_sigkill_loses_and_duplicates_nothing(tmp_path):
    steps = 60
    killed, whole = str(tmp_path / "killed.jsonl"), str(tmp_path / "whole.jsonl")
    proc = _child(killed, steps)
    deadline = time.time() + 60
    while _lines(killed) < 24 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1].decode()[-2000:]  # still running: killed mid-training
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    n_killed = _lines(killed)
    assert 24 <= n_killed < (steps // 2 + 1) * 3
    assert os.path.exists(killed + ".ckpt")
    rerun = _child(killed, steps)
    config = TrainConfig(width=16, heads=2, layers=1, batch=8, steps=steps, log_every=2, eval_images=16)
    track(config, [RunSpec("base"), RunSpec("flash", "flash", "paper:bf16", tiling=TILES)],
          [Pair("flash", "flash", "base", "flash")], out=whole)  # uninterrupted, meanwhile
    out, err = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, err.decode()[-2000:]
    a, b = load(killed), load(whole)
    assert a["key"].is_unique and len(a) == len(b) == (steps // 2 + 1) * 3
    assert _values(a).equals(_values(b))


def test_runs_as_independent_tasks_give_the_lockstep_rows(tmp_path):
    import concurrent.futures
    from fadev.training import track_tasks
    runs = [BASE, FLASH, RunSpec("seed1", init_seed=1)]
    pairs = [Pair("flash", "flash", "base", "flash"), Pair("init", "seed1", "base", "init")]
    config = TrainConfig(**{**TINY.__dict__, "steps": 5})  # the last logged step (5) is off the log_every grid
    drift, loss = track(config, runs, pairs)
    out = tmp_path / "tasks.jsonl"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        t_drift, t_loss = track_tasks(config, runs, pairs, out=str(out), executor=pool)
    assert list(drift["step"]) == [0, 0, 2, 2, 4, 4, 5, 5] and (drift["max_abs"][2:] > 0).all()
    assert _values(t_drift).equals(_values(drift)) and _values(t_loss).equals(_values(loss))
    before = out.read_bytes()
    again, _ = track_tasks(config, runs, pairs, out=str(out), executor="local", workers=2)  # all there: no training
    assert out.read_bytes() == before and _values(again).equals(_values(drift))
    with pytest.raises(ValueError, match="holds rows of another configuration"):
        track_tasks(TINY, runs[:2], pairs[:1], out=str(out))


def test_extending_steps_resumes_from_the_checkpoint(tmp_path):
    out = str(tmp_path / "r.jsonl")
    runs, pairs = [BASE, FLASH], [Pair("flash", "flash", "base", "flash")]
    short = TrainConfig(**{**TINY.__dict__, "steps": 4})
    track(short, runs, pairs, out=out)
    calls = []
    drift, _ = track(TINY, runs, pairs, out=out, callback=lambda s, m: calls.append(s))
    assert calls == [6]  # 0, 2, 4 came from the file and the checkpoint
    whole, _ = track(TINY, runs, pairs)
    assert _values(drift).equals(_values(whole))
    assert config_key(short, runs, pairs) == config_key(TINY, runs, pairs)


def test_errors(tmp_path):
    out = str(tmp_path / "r.jsonl")
    track(TINY, [BASE, FLASH], [Pair("flash", "flash", "base", "flash")], out=out)
    with pytest.raises(ValueError, match="another configuration"):
        track(TINY, [BASE], [], out=out)
    ckpt = str(tmp_path / "c.ckpt")
    os.replace(out + ".ckpt", ckpt)
    with pytest.raises(ValueError, match="checkpoint .* belongs to another configuration"):
        track(TINY, [BASE], [], checkpoint=ckpt)
    with pytest.raises(ValueError, match="duplicate run name"):
        track(TINY, [BASE, BASE], [])
    with pytest.raises(ValueError, match="pair 'p': no run named 'nope'"):
        track(TINY, [BASE], [Pair("p", "nope", "base")])
    with pytest.raises(ValueError, match="duplicate pair name"):
        track(TINY, [BASE, FLASH], [Pair("p", "flash", "base")] * 2)
    with pytest.raises(TypeError, match="config: expected a TrainConfig"):
        track({}, [BASE], [])
    with pytest.raises(TypeError, match="runs: expected RunSpec"):
        track(TINY, ["base"], [])
    with pytest.raises(ValueError, match="runs: need at least one"):
        track(TINY, [], [])
    with pytest.raises(TypeError, match="checkpoint must be"):
        track(TINY, [BASE], [], checkpoint=3)
    with pytest.raises(ValueError, match="kernel must be"):
        RunSpec("x", kernel="ring")
    with pytest.raises(ValueError, match="precision must be"):
        RunSpec("x", precision="fp8")
    with pytest.raises(ValueError, match="tiling needs kernel='flash'"):
        RunSpec("x", tiling={"block_kv": 8})
    with pytest.raises(ValueError, match="init_seed"):
        RunSpec("x", init_seed=-1)
    with pytest.raises(ValueError, match="run name"):
        RunSpec("a/b")
    with pytest.raises(TypeError, match="policy must be a preset string"):
        RunSpec("x", policy=fadev.Policy.golden())
    with pytest.raises(ValueError, match="role must be"):
        Pair("p", "a", "b", role="bogus")
    with pytest.raises(ValueError, match="width .* multiple of heads"):
        TrainConfig(width=10, heads=4)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="eval_images must be <= 297"):
        TrainConfig(eval_images=300)
    with pytest.raises(ValueError, match="lr must be"):
        TrainConfig(lr=-1.0)
    with pytest.raises(ValueError, match="precision must be one of"):
        digits.DigitsTransformer(16, 2, 1).set_precision("fp8")


def test_device_check():
    check_device("cpu")
    with pytest.raises(ValueError, match="device must be"):
        check_device("tpu")
    if not fadev.cuda_available():
        with pytest.raises(RuntimeError, match="--device cuda: no CUDA device"):
            check_device("cuda")


def test_experiment_runs_and_pairs():
    runs, pairs = runs_and_pairs(16, fp16=True)
    names = [r.name for r in runs]
    assert names == ["baseline", "flash_paper", "flash_fa2", "baseline_seed1", "fp32", "fp16", "control"]
    roles = [p.role for p in pairs]
    assert roles.count("flash") == 2 and roles.count("precision") == 2 and "control" in roles and "init" in roles


def test_cli_smoke(tmp_path, capsys):
    out = str(tmp_path / "res")
    assert main(["train-drift", "--quick", "--out", out, "--steps", "4", "--log-every", "2"] + SMALL_CLI) == 0
    for name in ("train_drift.jsonl", "train_drift.csv", "train_drift_loss.csv", "train_drift.md",
                 "train_drift_linear.png", "train_drift_log.svg", "train_drift_loss.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    report = open(os.path.join(out, "train_drift.md")).read()
    assert "Ratios" in report and "exactly 0 at every logged step" in report and "1/2..1/5" in report
    rows = [json.loads(line) for line in open(os.path.join(out, "train_drift.jsonl"))]
    assert len(rows) == 3 * (5 + 6)  # steps 0, 2, 4 x (5 pairs + 6 runs)
    if not fadev.cuda_available():
        assert main(["train-drift", "--out", out, "--device", "cuda"] + SMALL_CLI) == 1
        assert "--device cuda" in capsys.readouterr().err
