"""The Llama training-drift workload (fadev.training.text, lm, lm_track; ``train-drift --model llama``): the
corpus split is deterministic and disjoint, batches are a function of (step, seed), a tiny Llama learns, the
control arm stays bit-identical to the baseline, a run stopped by its deadline and resumed holds the bits of an
uninterrupted one, the CLI writes the report, and bad data paths are refused by name."""
import json
import os
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fadev  # noqa: E402
from fadev.__main__ import main  # noqa: E402
from fadev.experiments.train_drift import check_device, llama_runs_and_pairs, settings  # noqa: E402
from fadev.training import Pair, lm, lm_track, text  # noqa: E402

TINY = lm.LMConfig(hidden=32, layers=1, heads=2, heads_kv=1, ffn=64, seq=16, batch=2, lr=1e-2, steps=6, log_every=2,
                   checkpoint_every=3, eval_windows=2)
TINY_CLI = ["--hidden", "32", "--layers", "1", "--heads", "2", "--heads-kv", "1", "--ffn", "64", "--seq", "16",
            "--batch", "2", "--eval-windows", "2"]
BASE = lm.Arm("base", "baseline", "naive:bf16", "bf16")
FLASH = lm.Arm("flash", "flash", "fa2:bf16", "bf16", tiling={"block_q": 8, "block_kv": 8})
CONTROL = lm.Arm("control", "baseline", "naive:bf16", "bf16")
PAIRS = [Pair("flash", "flash", "base", "flash"), Pair("control", "control", "base", "control")]


def _values(df):
    return df.drop(columns=["seconds"], errors="ignore").set_index("key").sort_index()


def _state(folder, name):
    return torch.load(os.path.join(folder, lm_track.ARMS_DIR, name, "state.pt"), weights_only=True)


def _same_bits(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def test_corpus_split_is_deterministic_and_disjoint(tmp_path):
    corpus = text.load()
    assert not set(corpus.train_files) & set(corpus.held_out_files)
    assert sorted(corpus.train_files + corpus.held_out_files) == [rel for rel, _ in text.files()]
    assert all(text.held_out(f) for f in corpus.held_out_files) and not any(map(text.held_out, corpus.train_files))
    assert 0.02 < len(corpus.held_out_files) / len(corpus.train_files) < 0.1
    assert not any(f.startswith(("site-packages/", "dist-packages/")) for f in corpus.train_files)
    # a folder of our own: the split by path hash, the token streams exactly BOS + bytes + EOS per file
    names = [f"m{i}.txt" for i in range(60)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([65 + i % 26]) * (i + 1))
    (tmp_path / ".hidden").write_bytes(b"x")
    mine = text.load(str(tmp_path))
    held = [n for n in names if text.held_out(n)]
    assert mine.held_out_files == tuple(sorted(held)) and 0 < len(held) < len(names)
    expect = [t for n in sorted(held) for t in [text.BOS, *(tmp_path / n).read_bytes(), text.EOS]]
    assert mine.held_out.tolist() == expect and mine.train.max() < text.VOCAB
    assert mine.fingerprint == text.load.__wrapped__(str(tmp_path)).fingerprint
    (tmp_path / names[0]).write_bytes(b"changed")
    assert text.load.__wrapped__(str(tmp_path)).fingerprint != mine.fingerprint
    # a single file: its tail is held out
    one = tmp_path / "one.txt"
    one.write_bytes(bytes(range(200)))
    single = text.load(str(one))
    assert single.train.tolist() == [text.BOS, *range(190), text.EOS]
    assert single.held_out.tolist() == [text.BOS, *range(190, 200), text.EOS]


def test_batches_are_a_function_of_step_and_seed():
    tokens = np.arange(1000, dtype=np.uint16)
    x, y = text.batch(tokens, 7, 4, 16, data_seed=3)
    assert x.shape == y.shape == (4, 16) and x.dtype == np.int64
    assert (y[:, :-1] == x[:, 1:]).all() and (y[:, -1] == x[:, -1] + 1).all()
    assert (x == text.batch(tokens, 7, 4, 16, data_seed=3)[0]).all()
    assert not (x == text.batch(tokens, 8, 4, 16, data_seed=3)[0]).all()
    assert not (x == text.batch(tokens, 7, 4, 16, data_seed=4)[0]).all()
    ex, ey = text.eval_windows(tokens, 5, 16)
    assert ex[0, 0] == 0 and ey[-1, -1] == 999


def test_bad_data_is_refused_by_name(tmp_path, capsys):
    with pytest.raises(ValueError, match="data: .* is neither a file nor a folder"):
        text.files(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="data: no file under"):
        text.files(str(tmp_path))
    (tmp_path / "short.txt").write_bytes(b"abc")
    with pytest.raises(ValueError, match="data: the training split .* fewer than one window"):
        text.check(text.load(str(tmp_path / "short.txt")), 16)
    with pytest.raises(ValueError, match="heads_kv"):
        lm.LMConfig(heads=4, heads_kv=3)
    with pytest.raises(ValueError, match="kernel must be"):
        lm.Arm("x", kernel="ring")
    with pytest.raises(ValueError, match="precision must be one of fp32, bf16"):
        lm.Arm("x", precision="fp16")
    out = str(tmp_path / "res")
    assert main(["train-drift", "--model", "llama", "--out", out, "--data", str(tmp_path / "nope")] + TINY_CLI) == 1
    assert "data: " in capsys.readouterr().err
    assert main(["train-drift", "--model", "llama", "--out", out, "--width", "16"]) == 2
    assert "--width is not a setting of --model llama" in capsys.readouterr().err


def test_tiny_llama_arms_learn_and_the_control_stays_identical(tmp_path):
    arms = [BASE, FLASH, CONTROL, lm.Arm("fp32", "baseline", "golden", "fp32")]
    pairs = PAIRS + [Pair("prec", "base", "fp32", "precision")]
    drift, loss, reached = lm_track.track_arms(TINY, arms, pairs, str(tmp_path))
    assert {n: r[0] for n, r in reached.items()} == {a.name: 6 for a in arms}
    d = drift.set_index(["pair", "step"])
    assert list(drift["step"].unique()) == [0, 2, 4, 6]
    assert all(d.loc[("control", s), ["max_abs", "wasserstein", "rmse"]].eq(0).all() for s in (0, 2, 4, 6))
    for p in ("flash", "prec"):
        assert d.loc[(p, 0), "max_abs"] == 0 and all(d.loc[(p, s), "max_abs"] > 0 for s in (2, 4, 6))
    by = loss.set_index(["run", "step"])["eval_loss"]
    assert all(by[(a.name, 6)] < by[(a.name, 0)] for a in arms)  # it learns
    assert _same_bits(_state(tmp_path, "base")["model"], _state(tmp_path, "control")["model"])
    assert "w0000006.pt" not in os.listdir(os.path.join(tmp_path, lm_track.ARMS_DIR, "base"))  # compared: deleted
    model = lm.build(TINY, 0, "bf16")
    assert sum(p.numel() for p in model.parameters()) == lm.parameters(TINY)
    assert type(model.lm_head).__name__ == "Linear" and model.lm_head.low == torch.bfloat16


class _Clock:
    """time.time() for lm: one second later at every call."""

    def __init__(self):
        self.now = 1e9

    def time(self):
        self.now += 1.0
        return self.now


def test_stop_at_the_deadline_and_resume_give_the_uninterrupted_bits(tmp_path, monkeypatch):
    config = lm.LMConfig(**{**TINY.__dict__, "steps": 12})
    straight, parts = str(tmp_path / "straight"), str(tmp_path / "parts")
    whole, whole_loss, _ = lm_track.track_arms(config, [BASE, FLASH, CONTROL], PAIRS, straight)
    # call 1: the first 6 updates (steps=6 is the same configuration, stopped earlier)
    lm_track.track_arms(lm.LMConfig(**{**TINY.__dict__, "steps": 6}), [BASE, FLASH, CONTROL], PAIRS, parts)
    # call 2: one arm alone, stopped by a deadline after a few updates (a clock that ticks at every look)
    clock = _Clock()
    monkeypatch.setattr(lm, "time", types.SimpleNamespace(time=clock.time, perf_counter=lambda: 0.0))
    key = lm.study_key(config, [BASE, FLASH, CONTROL], PAIRS, text.load().fingerprint)
    root = os.path.join(parts, lm_track.ARMS_DIR)
    task = lm.ArmTask(config, {"flash": FLASH}, key, root, deadline=clock.now + 3.5)
    assert task({"run": "flash", "until": 12, "device": "cpu"})["step"] == 9
    monkeypatch.undo()
    # call 3: the rest
    drift, loss, reached = lm_track.track_arms(config, [BASE, FLASH, CONTROL], PAIRS, parts)
    assert {n: r[0] for n, r in reached.items()} == {"base": 12, "flash": 12, "control": 12}
    assert _values(drift).equals(_values(whole)) and _values(loss).equals(_values(whole_loss))
    for name in ("base", "flash"):
        a, b = _state(parts, name), _state(straight, name)
        assert _same_bits(a["model"], b["model"]) and a["step"] == b["step"] == 12
        assert all(torch.equal(x["exp_avg_sq"], y["exp_avg_sq"]) for x, y in
                   zip(a["opt"]["state"].values(), b["opt"]["state"].values()))
    with pytest.raises(ValueError, match="holds rows of another configuration"):
        lm_track.track_arms(lm.LMConfig(**{**TINY.__dict__, "lr": 2e-2}), [BASE], [], parts)
    os.remove(os.path.join(parts, "train_drift.jsonl"))
    with pytest.raises(ValueError, match="holds the state of another configuration"):
        lm_track.track_arms(lm.LMConfig(**{**TINY.__dict__, "lr": 2e-2}), [BASE], [], parts)


def test_cli_report_and_a_budget_that_stops_the_run(tmp_path, capsys):
    out = str(tmp_path / "res")
    args = ["train-drift", "--model", "llama", "--quick", "--out", out, "--log-every", "1", "--checkpoint-every",
            "2"] + TINY_CLI
    assert main(args + ["--steps", "2"]) == 0
    report = open(os.path.join(out, "train_drift.md")).read()
    assert "**Complete**" in report and "`native_128x64` (the native kernel runs on CUDA only" in report
    assert "partial run" not in report and ("— **holds**" in report or "— **does not hold**" in report)
    assert "exactly 0 at every logged step" in report and "train-drift --model llama --quick" in report
    rows = [json.loads(line) for line in open(os.path.join(out, "train_drift.jsonl"))]
    assert sum(r["kind"] != "layer" for r in rows) == 3 * (5 + 6)  # steps 0, 1, 2 x (5 pairs + 6 arms)
    assert sum(r["kind"] == "layer" for r in rows) == 3 * 5 * 4  # x (embed, layer 0, norm, lm_head)
    for name in ("train_drift.csv", "train_drift_loss.csv", "train_drift_linear.png", "train_drift_loss.svg"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    # more steps, but no time: nothing trains, the report is written from what is there and says so
    assert main(args + ["--steps", "4", "--budget-s", "1e-9"]) == 0
    report = open(os.path.join(out, "train_drift.md")).read()
    assert "**Partial run**" in report and "`flash_fa2` 2/4" in report
    # the ratios at step 2 of 4 judge the start of training: shown, without a verdict
    assert "partial run (step 2 of 4): no verdict yet" in report and "**holds**" not in report
    assert "**does not hold**" not in report and "Provisional (partial run, step 2 of 4)" in report
    assert len(open(os.path.join(out, "train_drift.jsonl")).readlines()) == len(rows)
    capsys.readouterr()
    assert main(args + ["--out", str(tmp_path / "empty"), "--budget-s", "1e-9"]) == 1
    assert "no arm got through its first logged step" in capsys.readouterr().err


def test_llama_arms_and_sizes():
    runs, pairs, skipped = llama_runs_and_pairs("cpu")
    assert [r.name for r in runs] == ["baseline", "flash_paper", "flash_fa2", "baseline_seed1", "fp32", "control"]
    assert set(skipped) == {"native_128x64", "native_64x64"}
    assert [p.role for p in pairs].count("flash") == 2 and "control" in [p.role for p in pairs]
    with pytest.raises(ValueError, match="native_tiles"):
        llama_runs_and_pairs("cpu", ("128-64",))
    some, some_pairs, some_skipped = llama_runs_and_pairs("cpu", arms=("baseline", "fp32", "native_64x64"))
    assert [r.name for r in some] == ["baseline", "fp32"] and [p.role for p in some_pairs] == ["precision"]
    assert list(some_skipped) == ["native_64x64"]
    with pytest.raises(ValueError, match="arms: unknown arm.*nope"):
        llama_runs_and_pairs("cpu", arms=("baseline", "nope"))
    full = settings("full", "llama")
    assert full["seq"] == 1024 and full["steps"] >= 5000
    assert lm.parameters(lm.LMConfig(**{k: full[k] for k in ("hidden", "layers", "heads", "heads_kv", "ffn")})) >= 25e6
    with pytest.raises(ValueError, match="unknown setting.*--model llama"):
        settings("quick", "llama", width=3)


@pytest.mark.gpu
@pytest.mark.skipif(not (fadev.cuda_available() and torch.cuda.is_available()), reason="needs a CUDA device and torch")
def test_llama_arms_on_the_gpu(tmp_path):
    """Models and attention on the GPU (emulated arms through fadev's GPU kernels, native arms on the tensor
    cores): the emulated control stays exactly 0 and a resumed emulated arm has the uninterrupted bits; the
    native arms train and drift from the baseline."""
    check_device("cuda")
    config = lm.LMConfig(hidden=128, layers=1, heads=2, heads_kv=1, ffn=64, seq=128, batch=2, lr=1e-2, steps=4,
                         log_every=2, checkpoint_every=2, eval_windows=2)
    runs, pairs, skipped = llama_runs_and_pairs("cuda", ("128x64", "64x64"), 64, head_dim=64)
    assert not skipped and {"native_128x64", "native_64x64", "native_128x64_again"} <= {r.name for r in runs}
    straight, parts = str(tmp_path / "straight"), str(tmp_path / "parts")
    drift, loss, reached = lm_track.track_arms(config, runs, pairs, straight, device="cuda")
    lm_track.track_arms(lm.LMConfig(**{**config.__dict__, "steps": 2}), runs, pairs, parts, device="cuda")
    resumed, _, _ = lm_track.track_arms(config, runs, pairs, parts, device="cuda")
    d = drift.set_index(["pair", "step"])
    assert (drift[drift["role"] == "control"][["max_abs", "wasserstein"]].to_numpy() == 0).all()
    assert all(d.loc[(p.name, 4), "max_abs"] > 0 for p in pairs if p.role == "flash")
    assert np.isfinite(loss["eval_loss"]).all()
    emulated = [p.name for p in pairs if p.role in ("flash", "precision", "init", "control") and "native" not in p.name]
    assert _values(resumed[resumed["pair"].isin(emulated)]).equals(_values(drift[drift["pair"].isin(emulated)]))
