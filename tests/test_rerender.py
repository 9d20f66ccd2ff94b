"""`python -m fadev report DIR`: a recorded folder's report rendered again from its CSVs (fadev/experiments/rerender.py).
Tested on the recorded folders themselves: the data rows and every number of the recorded report come back, the
counts are the findings', what the CSVs lack is named, a second rendering changes nothing, bad folders fail."""
import os
import re
import shutil

import pytest

from fadev.__main__ import main
from fadev.experiments import rerender

RESULTS = os.path.join(os.path.dirname(__file__), "..", "docs", "results")


def copy(name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(os.path.join(RESULTS, name), dst)
    return dst


def data_rows(text):
    """The table rows of the experiments' sections (not the summary, whose layout is the report's)."""
    body = text[text.index("## 1. "):]
    return [line for line in body.splitlines() if line.startswith("| ") and "---" not in line]


def test_ring_rows_and_candidates_come_back(tmp_path, capsys):
    folder = copy("ring-quick-cpu-2026-11-25", tmp_path)
    recorded = (folder / "ring.md").read_text()
    out = tmp_path / "again.md"
    assert main(["report", str(folder), "--out", str(out)]) == 0
    text = out.read_text()
    assert data_rows(recorded) == data_rows(text)
    assert "| 1 | fp16 inputs, grads cast to bf16 |" in text and "read back from the recorded report's table" in text
    assert "no claim with a verdict in this run" in capsys.readouterr().out
    assert text.count("Recorded run: ") == 1  # the run's own line, not nested on a second rendering


def test_kernels_names_what_the_csv_lacks_and_keeps_numbers(tmp_path):
    folder = copy("kernels-quick-h100-2026-11-22", tmp_path)
    recorded = (folder / "kernels.md").read_text()
    path, results = rerender.rerender(str(folder), out=str(tmp_path / "k.md"))
    text = open(path).read()
    numbers = lambda t: set(re.findall(r"\d\.\d+e[-+]\d+", t))  # noqa: E731
    assert numbers(recorded) <= numbers(text)
    assert "so torch math, reduced gets no verdict" in text and "the backward study" in text
    found = results["kernels"]["findings"]
    ok, n = sum(bool(f.holds) for f in found if f.holds is not None), sum(f.holds is not None for f in found)
    assert n > 0 and f"fadev's checks of its emulation (against real kernels, and its own invariances): {ok} of {n} hold" in text


def test_sizes_line_and_header_kept(tmp_path):
    folder = copy("train-drift-quick-cpu-2026-11-25", tmp_path)
    header = rerender._header((folder / "train_drift.md").read_text())
    path, results = rerender.rerender(str(folder), out=str(tmp_path / "t.md"))
    text = open(path).read()
    assert f"Recorded run: {header}" in text and "train_drift_loss.csv" in text
    assert "Claims of Golden et al. (arXiv 2405.02803): 0 of 4 hold" in text  # its four verdicts do not hold


def test_second_rendering_changes_nothing(tmp_path):
    folder = copy("paper-full-h200-2026-11-22", tmp_path)
    first, _ = rerender.rerender(str(folder), out=str(tmp_path / "one.md"))
    shutil.copy(first, folder / "report.md")
    second, _ = rerender.rerender(str(folder), out=str(tmp_path / "two.md"))
    assert open(first).read() == open(second).read()


def test_bad_folders(tmp_path, capsys):
    with pytest.raises(ValueError, match="no experiment CSV"):
        rerender.rerender(str(tmp_path))
    (tmp_path / "ring.csv").write_text("W\n1\n")
    with pytest.raises(ValueError, match="no recorded report"):
        rerender.rerender(str(tmp_path))
    assert main(["report", str(tmp_path)]) == 1 and "fadev report: " in capsys.readouterr().err


def test_llama_training_folders_render_as_their_workload(tmp_path, capsys):
    """A `train-drift --model llama` folder renders as the Llama study it is: its title and prose, its arms (read
    back from the rows) and progress (from the loss CSV), the real-kernel study's regime verdicts; a record whose
    report lost its sizes line is refused by name."""
    folder = copy("train-drift-llama-real-h100x2-2026-11-25", tmp_path)
    assert main(["report", str(folder)]) == 0
    text = (folder / "train_drift.md").read_text()
    assert text.startswith("# Training drift") and "--model llama`)" in text.split("\n", 1)[0]
    assert "`LlamaForCausalLM`" in text and "| `native` | native fa2(bf16), bf16_autocast model, init seed 0 |" in text
    assert "**Complete**" in text and "`native` 5000/5000" in text and "partly holds (for step <= 101)" in text
    quick = copy("train-drift-llama-quick-cpu-2026-11-25", tmp_path)
    assert main(["report", str(quick)]) == 0 and "`native_128x64` (the native kernel runs on CUDA only" in \
        (quick / "train_drift.md").read_text()
    lost = (quick / "train_drift.md").read_text().replace("Sizes (`quick`)", "Sizes")
    (quick / "train_drift.md").write_text(lost)
    capsys.readouterr()
    assert main(["report", str(quick)]) == 1 and "no sizes line" in capsys.readouterr().err
