"""The ring-dist study's parts in one process: the Llama-style model with a simulated ring under the fp64
policy reproduces the exact fp64 model (and under fa2:bf16 does not); the findings' verdicts follow the data.
The study end to end (processes, gloo) is the recorded run in docs/results/ring-dist-quick-cpu-2026-11-25."""

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch")
from fadev.experiments import llama, ring_dist  # noqa: E402


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("merge", ["lowp_partials", "allgather"])
def test_simulated_ring_in_the_model(merge):
    cfg = llama.Config(vocab=32, dim=32, heads=4, heads_kv=2, ffn=64, layers=2)
    params = llama.init(cfg, seed=0)
    tokens, targets = llama.batch(cfg, 1, 16, seed=1)
    pos = np.arange(16)
    ref_loss, ref = llama.gradients(params, cfg, tokens, targets, pos, llama.exact_attention, 16)
    for policy, bound in (("golden", 1e-12), ("fa2:bf16", None)):
        attn = llama.simulated_attention(policy, 4, "zigzag", merge)
        loss, grads = llama.gradients(params, cfg, tokens, targets, pos, attn, 16)
        err = _rel(np.concatenate([grads[n].numpy().ravel() for n in ref]),
                   np.concatenate([ref[n].numpy().ravel() for n in ref]))
        if bound:
            assert err < bound and abs(float(loss - ref_loss)) < 1e-12 * abs(float(ref_loss)), (policy, err)
        else:
            assert err > 1e-4, (policy, err)  # bf16 attention is visible in the gradients


def _df(grow):
    rows = []
    for merge in ring_dist.MERGES:
        for L in (1, 4):
            for W in (1, 4):
                g = 1e-3 * (grow ** (W == 4)) * (1.5 if merge == "lowp_partials" else 1.0)
                rows.append({"kernel": "emulated", "merge": merge, "L": L, "W": W, "grad": g, "pred_grad": g,
                             "loss_diff": 1e-5, "pred_loss_diff": 1e-5, "max_dev_from_prediction": 1e-16,
                             "grad_attn": g, "grad_mlp": g, "grad_embed": g})
    return pd.DataFrame(rows)


def test_findings_follow_the_data():
    grows = [f.ours for f in ring_dist.findings(_df(3.0))]
    flat = [f.ours for f in ring_dist.findings(_df(1.0))]
    assert grows[0].startswith("grows with W") and "(x3.00)" in grows[0]
    assert flat[0].startswith("does not grow with W") and "(x1.00)" in flat[0]
    assert "fp32_partials" in grows[4] or "lowp_running" in grows[4] or "allgather" in grows[4]
    assert "x1.50 below lowp_partials" in grows[4]
    # the simulation-vs-ranks check: holds when the measured error is the predicted one, fails when it is not
    check = [f for f in ring_dist.findings(_df(1.0)) if f.holds is not None]
    assert len(check) == 1 and check[0].holds and "fp64 rounding level" in check[0].ours
    off = _df(1.0)
    off.loc[off["W"] == 4, "grad"] *= 1.05
    off["max_dev_from_prediction"] = 2e-3
    check = [f for f in ring_dist.findings(off) if f.holds is not None]
    assert len(check) == 1 and check[0].holds is False and "fp64 rounding level" not in check[0].ours
    table = ring_dist.table(_df(3.0))
    assert table.count("\n") == 1 + 16 and "| emulated | allgather | 4 | 4 |" in table


def test_cli_spawns_ranks_end_to_end(tmp_path, capsys):
    """`python -m fadev ring-dist --spawn 2` through the experiment CLI (the path torchrun also takes): the
    report is written and the simulation-vs-ranks check holds; --cluster is no option of it, and run() refuses one."""
    from fadev.__main__ import main
    out = tmp_path / "rd"
    args = ["ring-dist", "--spawn", "2", "--Ws", "1,2", "--Ls", "1", "--N", "16", "--dim", "16", "--heads", "2",
            "--heads-kv", "1", "--kernels", "emulated", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    report = (out / "ring_dist.md").read_text()
    assert "fadev's checks of its emulation (against real kernels, and its own invariances): 1 of 1 hold" in report
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:  # its command has no --cluster (its ranks are its own processes)
        main(args + ["--cluster", "ray"])
    assert exc.value.code == 2 and "unrecognized arguments: --cluster ray" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ring-dist runs its own ranks"):  # and the function refuses one too
        ring_dist.run(size="quick", out=str(tmp_path), cluster={"executor": "ray"})


def test_figures_use_a_log_axis_only_for_values_spanning_a_decade(tmp_path):
    """A 3.9e-3..4.6e-3 range on a log axis looks like growth: plots.value_scale draws it linear from 0, and keeps
    a log axis where the values span a decade."""
    from fadev import plots
    fig, axes = plots.figure(4, 3, 1, 2)
    narrow, wide = axes.ravel()
    assert plots.value_scale(narrow, [3.9e-3, 4.6e-3, 0.0, float("nan")]) == "linear"
    assert narrow.get_yscale() == "linear" and narrow.get_ylim()[0] == 0
    assert plots.value_scale(wide, [1e-6, 1e-4]) == "log" and wide.get_yscale() == "log"
    paths = ring_dist.figures(_df(1.0), str(tmp_path))
    assert len(paths) == 4 and all(p.endswith((".png", ".svg")) for p in paths)


def test_spawn_cuts_the_sizes_ring_sizes(monkeypatch):
    """`ring-dist --spawn 2 --quick` runs the quick ring sizes that fit 2 processes (W = 1, 2); ring sizes
    chosen explicitly are kept, and one above the world is still refused before anything is spawned."""
    from fadev.experiments import common, ring_dist
    monkeypatch.delenv("RANK", raising=False)
    cfg = ring_dist.fit_ring_sizes(common.sizes(ring_dist.SIZES, "quick", {"spawn": 2}), {"spawn": 2})
    assert cfg["Ws"] == (1, 2) and ring_dist.check_world(cfg) == 2
    assert ring_dist.fit_ring_sizes(common.sizes(ring_dist.SIZES, "quick"), {})["Ws"] == ring_dist.SIZES["quick"]["Ws"]
    chosen = {"spawn": 2, "Ws": (1, 2, 4)}
    cfg = ring_dist.fit_ring_sizes(common.sizes(ring_dist.SIZES, "quick", chosen), chosen)
    with pytest.raises(ValueError, match=r"^Ws: ring sizes \[4\] exceed the 2 processes"):
        ring_dist.check_world(cfg)
