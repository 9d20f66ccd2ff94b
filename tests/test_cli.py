"""The reproduction's command line: ``python -m fadev reproduce`` and the experiment subcommands --
help texts, the files they write (figures non-trivial: size and pixel variance), report.md's sections,
argument errors."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import fadev
from fadev.__main__ import build_parser, main
from fadev.experiments import EXPERIMENTS, cli

FADEV_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(fadev.__file__)))
TINY = {
    "precision": {"formats": ("bf16", "fp16", "fp32"), "N": 512, "n_query": 16, "seeds": 2},
    "seqlen": {"formats": ("bf16",), "Ns": (128, 512, 2048), "n_query": 16, "seeds": 2},
    "algorithm": {"N": 1024, "n_query": 16, "seeds": 2},
    "attribution": {"formats": ("bf16",), "N": 1024, "n_query": 16, "seeds": 1},
    "kernels": {"formats": ("bf16",), "Ns": (256, 1024), "n_query": 16, "seeds": 2},
    "fp8": {"N": 512, "n_query": 16, "D": 32, "seeds": 2},
}


def _counts(report):
    """{table heading: (hold, partly, of)} parsed from report.md's three summary tables ((0, 0, 0) for a table
    with no verdict), and the verdict column's tally under each (they must agree)."""
    counts, tally, current = {}, {}, None
    for line in report.split("## 1. ")[0].splitlines():
        m = re.fullmatch(r"### (.+?)(?:: (\d+) of (\d+) hold(?:, (\d+) partly)?)?", line)
        if m:
            current = m.group(1)
            counts[current] = (int(m.group(2) or 0), int(m.group(4) or 0), int(m.group(3) or 0))
            tally[current] = [0, 0, 0]
        elif current and line.startswith("| ") and not line.startswith("| experiment"):
            tally[current][0] += line.endswith("| holds |")
            tally[current][1] += "| **partly holds (" in line
            tally[current][2] += 1
    assert {k: tuple(v) for k, v in tally.items()} == counts
    return counts


def _stdout_counts(text):
    """[(hold, partly, of)] per source from the CLI's count line ((0, 0, 0) for a source it leaves out)."""
    line = next(line for line in text.splitlines() if "; report: " in line)
    out = []
    for name in ("Golden et al.", "FlashAttention-3", "fadev's checks"):
        m = re.search(re.escape(name) + r": (\d+) of (\d+) hold(?:, (\d+) partly)?", line)
        out.append((int(m.group(1)), int(m.group(3) or 0), int(m.group(2))) if m else (0, 0, 0))
    return out


def _subparsers(parser):
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


def test_help_documents_every_option(capsys):
    parser = build_parser()
    subs = _subparsers(parser)
    commands = [name.replace("_", "-") for name in EXPERIMENTS]
    assert {"reproduce", *commands} <= set(subs) and {"ring", "train-drift"} <= set(commands)
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    top = capsys.readouterr().out
    for name in ("reproduce", *commands):
        assert name in top and subs[name].description
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        for action in subs[name]._actions:
            for opt in action.option_strings:
                assert opt in text, (name, opt)
            assert action.help, (name, action.dest)
    for name, mod in EXPERIMENTS.items():  # every size and every size parameter can be chosen on the command line
        opts = {o for a in subs[name.replace("_", "-")]._actions for o in a.option_strings}
        assert {f"--{k.replace('_', '-')}" for k in mod.SIZES["quick"]} | {f"--{size}" for size in mod.SIZES} <= opts
        assert not any("_" in o for o in opts), (name, opts)  # one flag style: dashes


def test_flags_with_underscores_are_aliases():
    """fadev's flags are spelled with dashes; the underscore spelling of a long option is read as the same flag
    (values, positionals and what follows -- untouched), and an unknown flag is still an error either way."""
    from fadev.__main__ import dashed
    assert dashed(["seqlen", "--n_query", "8", "--gpus_per_point=0.5", "--out", "a_b", "--", "--x_y"]) == \
        ["seqlen", "--n-query", "8", "--gpus-per-point=0.5", "--out", "a_b", "--", "--x_y"]
    parser = build_parser()
    a = parser.parse_args(dashed(["seqlen", "--n_query", "8"]))
    b = parser.parse_args(["seqlen", "--n-query", "8"])
    assert a.n_query == b.n_query == 8
    with pytest.raises(SystemExit):
        main(["seqlen", "--n_queries", "8"])


def _check_figure(path):
    import matplotlib.image
    assert os.path.getsize(path) > 15_000, path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and min(img.shape[:2]) > 300
    assert float(img[..., :3].std()) > 0.05, f"{path} looks blank"  # white background + drawn content
    svg = path[:-4] + ".svg"
    with open(svg) as fh:
        assert os.path.getsize(svg) > 10_000 and fh.read(200).lstrip().startswith("<?xml")


def test_reproduce_quick_only_precision(tmp_path):
    """The real command at real quick sizes, in a fresh interpreter."""
    out = tmp_path / "res"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [FADEV_PARENT, os.environ.get("PYTHONPATH")])),
           "MPLBACKEND": "Agg"}
    argv = [sys.executable, "-m", "fadev", "reproduce", "--quick", "--only", "precision", "--out", str(out),
            "--no-progress"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    for stem in ("fig3_precision_flash_vs_baseline", "fig4_precision_vs_golden"):
        _check_figure(str(out / f"{stem}.png"))
    report = (out / "report.md").read_text()
    assert "## 1. Numeric formats (Figs 3-4)" in report and "## Summary of the claims" in report
    assert "flash vs golden at bf16" in report and "claimed: ~10x" in report
    # at the quick sizes (N = 16384) flash deviates ~13x the baseline: the headline claim holds, and so does Fig 3's
    counts = _counts(report)
    assert list(counts.values()) == [(2, 0, 2), (0, 0, 0), (0, 0, 0)] == _stdout_counts(proc.stdout)
    assert "| precision | flash vs golden at bf16 (N=16384, D=64, 64x64 tiles) |" in report
    assert "ran on: the CPU;" in report and "ran on: the CPU." in report
    assert (out / "precision.csv").exists() and len((out / "precision.jsonl").read_text().splitlines()) == 21


@pytest.fixture
def tiny(monkeypatch):
    for name, sizes in TINY.items():
        monkeypatch.setitem(EXPERIMENTS[name].SIZES, "quick", {**EXPERIMENTS[name].SIZES["quick"], **sizes})


def test_reproduce_all_sections(tiny, tmp_path, capsys):
    out = str(tmp_path / "all")
    assert main(["reproduce", "--out", out, "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    with open(os.path.join(out, "report.md")) as fh:
        report = fh.read()
    counts = _counts(report)
    assert list(counts.values()) == _stdout_counts(stdout)
    golden, fa3, fadev_checks = counts.values()
    # at these tiny sizes (N = 512) flash is nowhere near ~10x the baseline: that verdict must fail
    assert re.search(r"\| precision \| flash vs golden at bf16 \(N=512.*\| \*\*does not hold\*\* \|", report)
    # fadev's checks: the loop-order invariance, and with torch the backward against PyTorch's CPU math backend
    # (plain and reduced precision) at bf16 and fp16
    n_checks = 1 + (4 if importlib.util.find_spec("torch") else 0)
    assert golden[0] < golden[2] and fa3 == (4, 0, 4) and fadev_checks == (n_checks, 0, n_checks)
    default = [mod for mod in EXPERIMENTS.values() if mod.REPRODUCE]
    assert [m.NAME for m in default] == ["precision", "seqlen", "algorithm", "attribution", "kernels", "fp8"]
    for i, mod in enumerate(default, 1):
        assert f"## {i}. {mod.TITLE}" in report
        for stem in mod.FIGURES:
            assert f"]({stem}.png)" in report
            _check_figure(os.path.join(out, f"{stem}.png"))
        assert os.path.exists(os.path.join(out, f"{mod.NAME}.csv"))
    assert "Which knobs change nothing, and why" in report
    assert "PyTorch's real SDPA kernels: not measured: the run used --device cpu" in report or "torch flash" in report
    assert "9.1e-03 (FA3 Table 3)" in report
    # rerunning reads every point back
    sizes = {m.NAME: os.path.getsize(os.path.join(out, f"{m.NAME}.jsonl")) for m in default}
    assert main(["reproduce", "--out", out, "--no-progress", "--only", "precision,fp8"]) == 0
    assert all(os.path.getsize(os.path.join(out, f"{n}.jsonl")) == s for n, s in sizes.items())


def test_experiment_subcommand_with_overrides(tmp_path, capsys):
    out = str(tmp_path / "one")
    assert main(["seqlen", "--Ns", "128,512", "--n_query", "8", "--seeds", "1", "--formats", "bf16", "--out", out,
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "bf16: max |flash - baseline| vs N" in text and "seqlen.md" in text
    with open(os.path.join(out, "seqlen.md")) as fh:
        md = fh.read()
    assert md.startswith("# Sequence length (Fig 5) (`python -m fadev seqlen`)") and "Method. " in md
    assert "Sizes (`quick`): formats=bf16, Ns=128/512, n_query=8, D=64" in md  # the parameters used
    _check_figure(os.path.join(out, "fig5_seqlen.png"))
    import pandas as pd
    df = pd.read_csv(os.path.join(out, "seqlen.csv"))
    assert list(df["N"]) == [128, 512] and set(df["n_query"]) == {8}


@pytest.mark.parametrize("argv, message", [
    (["reproduce", "--only", "precision,bogus"], "unknown experiment(s) bogus"),
    (["reproduce", "--quick", "--full"], "not allowed with argument"),
    (["reproduce", "--device", "tpu"], "invalid choice"),
    (["reproduce", "--workers", "0"], "expected a positive integer"),
    (["seqlen", "--Ns", "0,128"], "expected positive integers"),
    (["seqlen", "--Ns", "a,b"], "expected comma-separated integers"),
    (["precision", "--seeds", "x"], "expected a positive integer"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_size_override_is_reported(tmp_path, capsys):
    assert main(["fp8", "--D", "96", "--N", "128", "--n_query", "8", "--seeds", "1", "--out", str(tmp_path),
                 "--no-progress"]) == 1
    assert "D must be a power of two for the Hadamard rotation, got 96" in capsys.readouterr().err


def test_device_cuda_without_a_gpu_says_where_it_ran(tmp_path, capsys):
    from fadev.experiments import common
    if common.sweep_device("cuda") == "cuda":
        pytest.skip("fadev has CUDA kernels here: nothing falls back")
    out = str(tmp_path / "dev")
    assert main(["seqlen", "--Ns", "128,256", "--n_query", "8", "--seeds", "1", "--formats", "bf16", "--out", out,
                 "--no-progress", "--device", "cuda"]) == 0
    with open(os.path.join(out, "seqlen.md")) as fh:
        md = fh.read()
    assert "ran on: the CPU (asked for `--device cuda`: " in md and "device `cuda`" not in md


def test_help_texts_are_whole_and_plain(capsys):
    """Each experiment's description ends a sentence (no lead-in cut at ':'), shows no Sphinx markup, and its
    command lists --device and --cluster only where the experiment uses them (OPTIONS)."""
    subs = _subparsers(build_parser())
    for name, mod in EXPERIMENTS.items():
        sp = subs[name.replace("_", "-")]
        assert "``" not in sp.description and not re.search(r":[a-z]+:`", sp.description), name
        body = sp.description.split(" Writes DIR/")[0]
        assert body.endswith((".", "?", ")")) and not body.endswith(":."), (name, body)
        opts = {o for a in sp._actions for o in a.option_strings}
        wanted = set(getattr(mod, "OPTIONS", ("device", "cluster")))
        assert ("--device" in opts) == ("device" in wanted) and ("--cluster" in opts) == ("cluster" in wanted), name
    assert not {"--device", "--cluster"} & {o for a in subs["ring-dist"]._actions for o in a.option_strings}
    assert cli.help_text("First sentence. Lead-in:\n\n* a list") == "First sentence."
    assert cli.help_text("Only a lead-in: with :func:`x` and ``y``:") == "Only a lead-in: with `x` and `y`."
    assert cli.help_text("A :class:`fadev.Policy`.\n\nMore prose.") == "A `fadev.Policy`. More prose."


def test_terminal_notes_say_what_did_not_run(monkeypatch):
    kernels = EXPERIMENTS["kernels"]
    fell = {"kernels": {"experiment": kernels, "ran_on": "the CPU (asked for `--device cuda`: fadev has no usable CUDA "
                                                         "device here), PyTorch's kernels not run"}}
    monkeypatch.setattr(cli.common, "torch_available", lambda: True)
    assert cli.notes(fell, "cuda") == ["note: --device cuda ran on the CPU for kernels (fadev has no usable CUDA "
                                       "device here)"]
    assert cli.notes({"kernels": {"experiment": kernels, "ran_on": "the GPU"}}, "cuda") == []
    fp8 = {"experiment": EXPERIMENTS["fp8"], "ran_on": EXPERIMENTS["fp8"].ran_on("cuda")}
    assert cli.notes({**fell, "fp8": fp8}, "cuda") == [
        "note: --device cuda ran on the CPU for kernels (fadev has no usable CUDA device here); fp8 (always: fp8 "
        "scaling and rotation run outside the sweep engine)"]
    assert cli.notes({**fell, "fp8": fp8}, "cpu") == []
    monkeypatch.setattr(cli.common, "torch_available", lambda: False)
    [line] = cli.notes({"kernels": {"experiment": kernels, "ran_on": "the CPU"}}, "cpu")
    assert "PyTorch is not installed" in line and kernels.NEEDS_TORCH in line and cli.TORCH_CPU in line
    assert cli.notes({"fp8": {"experiment": EXPERIMENTS["fp8"], "ran_on": "the CPU"}}, "cpu") == []
