"""Every recorded folder under docs/results renders again from its CSVs to exactly its committed report (the
re-rendering date aside): a change of the report code that would change a record's report, or a record edited by
hand, fails here until `python -m fadev report docs/results/NAME` is run and its output committed. A folder that
cannot be rendered from its CSVs (:func:`unrenderable`) must fail for that reason and no other."""
import difflib
import os
import re
import shutil

import pytest

from fadev.experiments import EXPERIMENTS, rerender

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "results")


def unrenderable(folder):
    """Why a recorded folder cannot be rendered from its CSVs (the error rerender must raise), or None: a folder
    without an experiment's CSV (a study's own CSV, e.g. the backward ratios, with its report in its README).
    (`train-drift --model llama` folders render: their arms and prose are read back, tests/test_rerender.py.)"""
    names = [n for n in EXPERIMENTS if os.path.exists(os.path.join(folder, f"{n}.csv"))]
    if not names:
        return "no experiment CSV"
    return None


RENDERED_ON = re.compile(r"(by `python -m fadev report DIR` \(fadev [^,]+, )\d{4}-\d{2}-\d{2}\)")


def normalized(text):
    return RENDERED_ON.sub(r"\1DATE)", text)


@pytest.mark.parametrize("name", sorted(os.listdir(RESULTS)))
def test_record_matches_its_rendering(name, tmp_path):
    folder = tmp_path / name
    shutil.copytree(os.path.join(RESULTS, name), folder)  # rendered in place: the figures' links stay relative
    reason = unrenderable(str(folder))
    if reason:
        with pytest.raises(ValueError, match=reason):
            rerender.rerender(str(folder))
        return
    paths, _ = rerender.rerender(str(folder))
    for path in paths if isinstance(paths, list) else [paths]:
        with open(os.path.join(RESULTS, name, os.path.basename(path))) as fh:
            recorded = normalized(fh.read())
        with open(path) as fh:
            again = normalized(fh.read())
        diff = "\n".join(list(difflib.unified_diff(recorded.splitlines(), again.splitlines(), "recorded", "rendered",
                                                   lineterm="", n=0))[:40])
        assert again == recorded, (f"docs/results/{name}/{os.path.basename(path)} differs from its rendering from the "
                                   f"CSVs: run `python -m fadev report docs/results/{name}` and commit it\n{diff}")


def test_the_check_fails_on_a_changed_record(tmp_path):
    """The comparison above can fail: a record whose report was edited no longer matches its rendering."""
    name = "ring-dist-quick-cpu-2026-11-25"
    folder = tmp_path / name
    shutil.copytree(os.path.join(RESULTS, name), folder)
    [path] = [p for p, _ in rerender.reports(str(folder))]
    with open(path) as fh:
        text = fh.read()
    first = re.search(r"\d\.\d\de-\d\d", text.split("## 1. ")[1]).group(0)
    edited = text.replace(first, "9.99e-99", 1)
    with open(path, "w") as fh:
        fh.write(edited)
    rerender.rerender(str(folder))
    with open(path) as fh:
        assert normalized(fh.read()) != normalized(edited)
