"""``train-drift --model llama --kernels real`` (fadev.experiments.train_drift_real): the real-kernel arms train
under real autocast from one init, identical arms stay bit-identical, the regimes, growth rates and verdicts
are computed from the rows -- each verdict shown to hold on data where it must and to fail where it must --
and per-layer distances add up to the model's."""
import math
import os
import re

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fadev  # noqa: E402
from fadev import weights  # noqa: E402
from fadev.__main__ import main  # noqa: E402
from fadev.experiments import train_drift, train_drift_real as real  # noqa: E402
from fadev.training import lm, lm_track  # noqa: E402

STEPS = [1, 2, 4, 8, 16, 32, 64, 128]


def _frame(curves, roles):
    """A drift frame with rel_l2 = max_abs = wasserstein = curves[pair][i] at STEPS (and 0 at step 0)."""
    rows = []
    for pair, values in curves.items():
        rows.append({"step": 0, "pair": pair, "role": roles[pair], "rel_l2": 0.0, "max_abs": 0.0, "wasserstein": 0.0})
        for s, v in zip(STEPS, values):
            rows.append({"step": s, "pair": pair, "role": roles[pair], "rel_l2": v, "max_abs": v, "wasserstein": v})
    return pd.DataFrame(rows)


FLASH, NATIVE = "flash (SDPA) vs baseline", "native vs baseline"
ROLES = {"flash": "flash", FLASH: "flash", NATIVE: "flash", "prec": "precision", "init": "init",
         "control (identical runs)": "control"}
INIT = [1.0] * len(STEPS)
ZERO = [0.0] * len(STEPS)


def _power(scale, exponent):
    return [scale * s ** exponent for s in STEPS]


def test_verdicts_hold_where_they_must_and_fail_where_they_must():
    # flash at 0.3x the precision drift, far below the init drift, native alike: every verdict holds
    good = _frame({FLASH: _power(3e-4, 0.5), NATIVE: _power(4e-4, 0.5), "prec": _power(1e-3, 0.5),
                   "init": INIT, "control (identical runs)": ZERO}, ROLES)
    verdicts = {f.claim: f.holds for f in real.findings(good)}
    assert verdicts[f"{FLASH}: drift / bf16-vs-fp32 drift (rel_l2), apart regime"] is True
    assert verdicts[f"{FLASH}: drift / init-seed drift (rel_l2), apart regime"] is True
    assert verdicts[f"{NATIVE} / {FLASH} (rel_l2): two flash kernels drift alike"] is True
    # flash as large as the precision drift, native 5x flash, flash at 0.2 of the init drift: each fails
    bad = _frame({FLASH: _power(1e-3, 0.5), NATIVE: _power(5e-3, 0.5), "prec": _power(1e-3, 0.5),
                  "init": [0.5] * len(STEPS), "control (identical runs)": ZERO}, ROLES)
    bad.loc[bad["pair"] == FLASH, "rel_l2"] *= 100  # 0.1..1.13: saturated (>= 0.5 x 0.5) from step 8 on
    bad_verdicts = {f.claim: (f.holds, f.ours) for f in real.findings(bad)}
    assert bad_verdicts[f"{FLASH}: drift / bf16-vs-fp32 drift (rel_l2), apart regime"][0] is False
    assert bad_verdicts[f"{FLASH}: drift / init-seed drift (rel_l2), apart regime"][0] is False
    assert bad_verdicts[f"{NATIVE} / {FLASH} (rel_l2): two flash kernels drift alike"][0] is False
    # only the unsaturated steps enter the apart regime: 0.1, 0.14, 0.2 at steps 1, 2, 4 (< 0.25)
    regime = real.state(bad)[FLASH]
    assert [s for s in STEPS if regime[s] == "apart"] == [1, 2, 4] and regime[8] == regime[128] == "saturated"


def test_regimes_noise_and_growth():
    noisy = _frame({"flash": _power(1e-4, 1.0), "prec": _power(2e-4, 1.0), "init": INIT,
                    "control (identical runs)": [5e-3] * len(STEPS)}, ROLES)
    regime = real.state(noisy)
    # flash = 1e-4 * step: under 2 x 5e-3 (noise) up to step 64, apart at 128 only
    assert [regime["flash"][s] for s in STEPS] == ["noise"] * 7 + ["apart"]
    growth = {g["pair"]: g for g in real.growth(_frame({"flash": _power(1e-5, 0.75), "prec": _power(1e-4, 1.5),
                                                        "init": INIT, "control (identical runs)": ZERO}, ROLES))}
    assert growth["flash"]["exponent"] == pytest.approx(0.75) and growth["flash"]["saturated_at"] is None
    assert growth["prec"]["exponent"] == pytest.approx(1.5)
    fast = {g["pair"]: g for g in real.growth(_frame({"flash": _power(1e-5, 0.75), "prec": _power(1e-2, 1.5),
                                                      "init": INIT, "control (identical runs)": ZERO}, ROLES))}
    assert fast["prec"]["saturated_at"] == 16 and fast["prec"]["steps"] == 4  # 1e-2 * 16^1.5 = 0.64 >= 0.5
    # no apart step at all (flash under the control's noise everywhere): no verdict, and the text says why
    louder = _frame({"flash": _power(1e-4, 1.0), "prec": _power(2e-4, 1.0), "init": INIT,
                     "control (identical runs)": [1e-2] * len(STEPS)}, ROLES)
    holds, text, partly = real.verdict(louder, "flash", "prec", 0.2, 0.5)
    assert holds is None and "no step where both pairs are apart" in text and partly == ""


def test_a_bound_that_holds_early_partly_holds():
    """In the band for the first four logged steps and out of it after: over the regime it fails, and the verdict
    says where it holds ("partly holds (for step <= 8)"); out of the band everywhere: no partly."""
    prec = _power(1e-3, 1.0)
    flash = [p * (0.35 if s <= 8 else 0.9) for p, s in zip(prec, STEPS)]
    frame = _frame({FLASH: flash, "prec": prec, "init": INIT, "control (identical runs)": ZERO}, ROLES)
    found = {f.claim: f for f in real.findings(frame)}[f"{FLASH}: drift / bf16-vs-fp32 drift (rel_l2), apart regime"]
    assert found.holds is False and found.partly == "for step <= 8" and "partly holds (for step <= 8)" in \
        found.markdown()
    assert real.verdict(frame, FLASH, "prec", 0.95, 2.0)[::2] == (False, "")


def test_weights_groups_add_up_to_the_model():
    rng = np.random.default_rng(0)
    a = {f"model.layers.{i}.w": rng.standard_normal((8, 4)) for i in range(3)}
    a["lm_head.weight"] = rng.standard_normal((5, 4))
    b = {k: v + 1e-3 * rng.standard_normal(v.shape) for k, v in a.items()}
    df = weights.compare(a, b, groups=lm.layer_of)
    groups = {g["name"]: g for g in df.attrs["groups"]}
    assert list(groups) == ["layer 0", "layer 1", "layer 2", "lm_head"]
    for i in range(3):
        one = weights.compare({"w": a[f"model.layers.{i}.w"]}, {"w": b[f"model.layers.{i}.w"]}).attrs["model"]
        assert groups[f"layer {i}"]["rel_l2"] == one["rel_l2"] and groups[f"layer {i}"]["max_abs"] == one["max_abs"]
    assert max(g["max_abs"] for g in groups.values()) == df.attrs["model"]["max_abs"]
    assert math.fsum(g["rmse"] ** 2 * g["numel"] for g in groups.values()) == pytest.approx(
        df.attrs["model"]["rmse"] ** 2 * df.attrs["model"]["numel"], rel=1e-12)
    with pytest.raises(TypeError, match="groups"):
        weights.compare(a, b, groups="layer")
    assert [lm.layer_of(n) for n in ("model.embed_tokens.weight", "model.layers.7.mlp.up_proj.weight",
                                     "model.norm.weight", "lm_head.weight")] == ["embed", "layer 7", "norm", "lm_head"]


def test_logged_steps_are_log_spaced_from_the_first_update():
    config = lm.LMConfig(steps=5000, log_every=500, log_points=25)
    steps = config.logged_steps()
    assert steps[:6] == [0, 1, 2, 3, 4, 6] and steps[-1] == 5000 and 500 in steps and 4500 in steps
    assert len(steps) == len(set(steps)) and steps == sorted(steps)
    assert lm.LMConfig(steps=10, log_every=5).logged_steps() == [0, 5, 10]
    with pytest.raises(ValueError, match="log_points"):
        lm.LMConfig(log_points=-1)


def test_arms_and_settings():
    runs, pairs, skipped = real.runs_and_pairs("cpu")
    assert [r.name for r in runs] == ["baseline", "flash", "fp32", "baseline_seed1", "control"]
    assert set(skipped) == {"native"} and {p.role for p in pairs} == {"flash", "init", "precision", "control"}
    runs, pairs, skipped = real.runs_and_pairs("cuda", arms=("all", "flash_again", "native_again"))
    assert len(runs) == 8 and not skipped and [p.role for p in pairs].count("control") == 3
    assert real.runs_and_pairs("cuda", head_dim=32)[2] == {"native": "the native kernel takes head dim 64 or 128, "
                                                                     "not 32"}
    with pytest.raises(ValueError, match="unknown arm.*nope"):
        real.runs_and_pairs("cpu", arms=("all", "nope"))
    full = train_drift.settings("full", "llama", kernels="real")
    assert (full["hidden"], full["layers"], full["heads"], full["heads_kv"], full["seq"], full["batch"]) == \
        (512, 8, 8, 4, 1024, 8) and full["steps"] >= 5000 and full["log_points"] > 0
    assert lm.parameters(lm.LMConfig(**{k: full[k] for k in ("hidden", "layers", "heads", "heads_kv", "ffn")})) > 23e6
    assert train_drift.settings("full", "llama", kernels="real", steps=7)["steps"] == 7  # the call's value wins
    with pytest.raises(ValueError, match="kernels must be"):
        train_drift.settings("quick", "llama", kernels="fast")
    with pytest.warns(DeprecationWarning, match="heads_kv"):  # the old spelling still works
        assert train_drift.settings("quick", "llama", kv_heads=2)["heads_kv"] == 2


def test_quick_real_study_on_the_cpu(tmp_path, capsys):
    """The CI-sized study end to end: one init (every pair 0 at step 0 but seed 1), the control exactly 0, real
    autocast and the flash kernel moving the weights, per-layer rows and the report's computed verdicts."""
    out = str(tmp_path / "real")
    assert main(["train-drift", "--model", "llama", "--kernels", "real", "--quick", "--out", out]) == 0
    df = pd.read_csv(os.path.join(out, "train_drift.csv"))
    at0 = df[df["step"] == 0].set_index("pair")["rel_l2"]
    assert at0.drop("init seed 1 vs seed 0").eq(0).all() and at0["init seed 1 vs seed 0"] > 0.1
    last = df[df["step"] == df["step"].max()].set_index("pair")["rel_l2"]
    assert last["control (identical runs)"] == 0 and last["flash (SDPA) vs baseline"] > 0
    assert last["bf16 autocast vs fp32"] > 0
    layers = pd.read_csv(os.path.join(out, "train_drift_layers.csv"))
    assert set(layers["group"]) == {"embed", "layer 0", "layer 1", "norm", "lm_head"}
    report = open(os.path.join(out, "train_drift.md")).read()
    assert "apart regime" in report and "**Growth**" in report and "`native` (the native kernel runs on CUDA" in report
    for name in ("train_drift_loglog.png", "train_drift_layers.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not (fadev.cuda_available() and torch.cuda.is_available()), reason="needs a CUDA device and torch")
def test_real_arms_on_the_gpu(tmp_path):
    """Eager, SDPA flash and fadev's native kernel under real autocast, each run twice: all three controls stay
    exactly 0 (deterministic kernels and cuBLAS), the flash kernels move the weights, and the GPU distances equal
    the CPU's (exact max and Wasserstein; sums within rounding)."""
    train_drift.check_device("cuda")
    config = lm.LMConfig(hidden=128, layers=2, heads=2, heads_kv=1, ffn=64, seq=256, batch=2, lr=1e-3, steps=4,
                         log_every=2, log_points=3, checkpoint_every=4, eval_windows=2)
    runs, pairs, skipped = real.runs_and_pairs("cuda", 64, ("all", "flash_again", "native_again"))
    assert not skipped
    drift, loss, reached = lm_track.track_arms(config, runs, pairs, str(tmp_path), device="cuda")
    assert all(r == (4, reached[n][1]) for n, r in reached.items())
    control = drift[drift["role"] == "control"]
    assert len(control) == 3 * len(config.logged_steps()) and (control[["max_abs", "rel_l2"]].to_numpy() == 0).all()
    d = drift.set_index(["pair", "step"])
    assert d.loc[("flash (SDPA) vs baseline", 4), "rel_l2"] > 0 and d.loc[("native vs baseline", 4), "rel_l2"] > 0
    assert np.isfinite(loss["eval_loss"]).all()
    rng = torch.Generator().manual_seed(0)
    a = {f"t{i}": torch.randn(1000 + i, generator=rng) for i in range(3)}
    b = {k: v + 1e-3 * torch.randn(v.shape, generator=rng) for k, v in a.items()}
    cpu = weights.compare(a, b).attrs["model"]
    gpu = weights.compare({k: v.cuda() for k, v in a.items()}, {k: v.cuda() for k, v in b.items()}).attrs["model"]
    assert gpu["max_abs"] == cpu["max_abs"] and gpu["wasserstein"] == pytest.approx(cpu["wasserstein"], rel=1e-14)
    assert gpu["rel_l2"] == pytest.approx(cpu["rel_l2"], rel=1e-12)


def test_emulated_arms_verdicts_both_ways():
    """--kernels emulated_real: the validation (emulated fa2 drifts as the real flash does) and the paper's setting
    (paper(bf16) drifts >= 2x fa2(bf16)) hold on data made to hold them and fail on data made to fail them."""
    fa2, paper, sdpa = ("flash fa2(bf16) vs emulated baseline", "flash paper(bf16) vs emulated baseline",
                        "flash (SDPA) vs baseline")
    roles = {fa2: "flash", paper: "flash", sdpa: "flash", "control (identical runs)": "control"}

    def claims(curves):
        found = {f.claim.split(" (rel_l2)")[0]: f.holds for f in real.findings(_frame(curves, roles))}
        return found[f"{fa2} / {sdpa}"], found[f"{paper} / {fa2}"]

    assert claims({fa2: _power(1e-3, 1), paper: _power(3e-3, 1), sdpa: _power(1.2e-3, 1),
                   "control (identical runs)": ZERO}) == (True, True)
    assert claims({fa2: _power(1e-3, 1), paper: _power(1.2e-3, 1), sdpa: _power(4e-3, 1),
                   "control (identical runs)": ZERO}) == (False, False)
    runs, pairs, skipped = real.runs_and_pairs("cpu", kernels="emulated_real")
    assert [r.name for r in runs] == ["baseline", "flash", "baseline_emulated", "flash_fa2", "flash_paper",
                                      "control_emulated"] and not skipped
    assert {p.name for p in pairs} >= {fa2, paper, sdpa} and all(r.precision == "bf16_autocast" for r in runs)
    with pytest.raises(ValueError, match="kernels must be"):
        real.runs_and_pairs("cpu", kernels="emulated")


def test_emulated_real_study_on_the_cpu(tmp_path):
    out = str(tmp_path / "emulated")
    assert main(["train-drift", "--model", "llama", "--kernels", "emulated_real", "--quick", "--out", out,
                 "--steps", "6", "--log-points", "3", "--log-every", "6", "--checkpoint-every", "6"]) == 0
    df = pd.read_csv(os.path.join(out, "train_drift.csv"))
    last = df[df["step"] == 6].set_index("pair")["rel_l2"]
    assert last["control (identical runs)"] == 0 and (last.drop("control (identical runs)") > 0).all()
    report = open(os.path.join(out, "train_drift.md")).read()
    assert "the emulated FA2 drifts from its baseline as the real flash kernel" in report and "nan" not in report
    assert "--kernels emulated_real" in report


def test_a_stopped_run_cut_where_every_arm_got(tmp_path):
    """A run whose lease ended before every arm was done (here: the emulated baseline's rows after update 5 removed,
    as if it had stopped at 5) gets no verdict; `report DIR --until 5` reads it up to update 5, which every arm
    reached, computes the verdicts there, says so, draws the figures from those rows, and a later rendering keeps
    the cut. A cut past an arm's progress, or off the logged steps, or of another experiment, is refused."""
    from fadev.experiments import rerender
    out = str(tmp_path / "stopped")
    assert main(["train-drift", "--model", "llama", "--kernels", "emulated_real", "--quick", "--out", out,
                 "--steps", "8", "--log-points", "5", "--log-every", "8", "--checkpoint-every", "8"]) == 0
    again = re.search(r"Regenerate with `([^`]*)`", open(os.path.join(out, "train_drift.md")).read()).group(1)
    assert again.startswith("python -m fadev train-drift --model llama --kernels emulated_real --quick ")
    assert set(again.split()[9:-2]) == {"--steps", "8", "--log-points", "5", "--log-every", "--checkpoint-every"}
    drift = pd.read_csv(os.path.join(out, "train_drift.csv"))
    loss = pd.read_csv(os.path.join(out, "train_drift_loss.csv"))
    late = (drift["step"] > 5) & ((drift["a"] == "baseline_emulated") | (drift["b"] == "baseline_emulated"))
    drift[~late].to_csv(os.path.join(out, "train_drift.csv"), index=False)
    loss[~((loss["run"] == "baseline_emulated") & (loss["step"] > 5))].to_csv(
        os.path.join(out, "train_drift_loss.csv"), index=False)
    os.remove(os.path.join(out, "train_drift_loss.png"))
    _, results = rerender.rerender(out)
    assert all(f.holds is None for f in results["train_drift"]["findings"])  # partial: no verdict
    for bad, match in ((8, "did not reach it"), (4, "not a logged step"), (0, "positive integer")):
        with pytest.raises(ValueError, match=match):
            rerender.rerender(out, until=bad)
    _, results = rerender.rerender(out, until=5)
    judged = {f.claim.split(" (rel_l2)")[0]: f.holds for f in results["train_drift"]["findings"]}
    assert judged["flash fa2(bf16) vs emulated baseline / flash (SDPA) vs baseline"] is not None
    report = open(os.path.join(out, "train_drift.md")).read()
    assert "**Cut at update 5 of 8**" in report and "`baseline_emulated` 5" in report
    assert "the run stopped before every arm was done" in report
    assert os.path.getsize(os.path.join(out, "train_drift_loss.png")) > 0  # drawn again from the cut rows
    rerender.rerender(out)
    assert open(os.path.join(out, "train_drift.md")).read().count("**Cut at update 5 of 8**") == 2
    assert main(["report", out, "--until", "5"]) == 0
    other = str(tmp_path / "digits")
    assert main(["train-drift", "--quick", "--out", other, "--steps", "4", "--log-every", "2"]) == 0
    with pytest.raises(ValueError, match="only a train-drift --model llama run"):
        rerender.rerender(other, until=2)
