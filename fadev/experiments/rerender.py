"""A recorded results folder's report rendered again from its CSVs (``python -m fadev report DIR``).

The report format changes (the summary's three tables, computed finding texts); recorded runs need not be
rerun for it. :func:`rerender` reads every DIR/NAME.csv of a known experiment, recomputes the findings and
tables from those rows with the current code and writes the report in the current format: the numbers are
the recorded ones, only the rendering is new. What the current report needs but the CSVs never held (a
table an experiment keeps beside its rows, in ``df.attrs``) is named in the report, not invented. The
recorded report's header line (its date, machine, device, time) and each section's sizes line are kept as
they were written; the figures are the recorded files.
"""
from __future__ import annotations

import datetime
import glob
import os
import re

import pandas as pd

from .. import __version__, report
from . import EXPERIMENTS, METHOD, PAPER
from . import train_drift_real
from .headline import headline

ATTR_TABLES = {"kernels": {"backward": "kernels_backward.csv", "tiles": "kernels_tiles.csv"},
               "train_drift": {"loss": "train_drift_loss.csv"}}
"""{experiment: {df.attrs key: the CSV in DIR that holds it}}."""

ATTR_MISSING = {"kernels": {"backward": "the backward study (emulated backward presets vs PyTorch's backward "
                                        "kernels): the run predates it, or its rows were not written to a CSV"},
                "ring": {"candidates": "the candidate causes and the factor each multiplies the error by (kept "
                                       "beside the rows, never written to a CSV)"}}
"""What the report shows from a df.attrs table that a recorded folder may lack: {experiment: {key: text}}."""


def _recorded_text(folder, names):
    """The recorded report: DIR/report.md, else DIR/NAME.md of the (single) experiment; (path, text)."""
    for stem in ["report"] + list(names):
        path = os.path.join(folder, f"{stem}.md")
        if os.path.exists(path):
            with open(path) as fh:
                return path, fh.read()
    raise ValueError(f"report: no recorded report (report.md or NAME.md) in {folder}")


def _header(text):
    """The recorded report's first paragraph after its heading (the line on its run), its headline skipped."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip() and not p.strip().startswith("**In short.**")]
    first = paragraphs[1] if len(paragraphs) > 1 and paragraphs[0].startswith("#") else paragraphs[0]
    return first.removeprefix("Recorded run: ")  # a report rendered again keeps the run's own line


def _size(text, folder):
    match = re.search(r"`(quick|full)` sizes", text) or re.search(r"\((quick|full)\)", text.split("\n", 1)[0])
    if match:
        return match.group(1)
    return "full" if "full" in os.path.basename(os.path.normpath(folder)) else "quick"


def _sizes_line(text, name):
    """(sizes text, seconds) of experiment ``name``'s section in the recorded report, or (None, nan)."""
    match = re.search(r"Sizes \(`\w+`\): (.*?)\. Raw rows: `" + re.escape(name) + r"\.jsonl`; this table: `" +
                      re.escape(name) + r"\.csv`; ([0-9.]+) s", text)
    return (match.group(1), float(match.group(2))) if match else (None, float("nan"))


def _candidates(text):
    """ring's candidate causes read back from the recorded report's table (as printed: 4 significant digits,
    which is all the report shows again), or None."""
    head = "| rank | candidate | what | before | after | factor |"
    if head not in text:
        return None
    rows = []
    for line in text[text.index(head):].splitlines()[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 6:
            break
        rows.append({"candidate": cells[1].replace("\\|", "|"), "detail": cells[2].replace("\\|", "|"),
                     "before": float(cells[3]), "after": float(cells[4]), "factor": float(cells[5])})
    return rows


def _result(folder, name, size, device, text, until=None, figures_dir=None):
    """One experiment's results read back from ``folder``; ``until``: cut a train-drift --model llama run there
    (train_drift_real.cut; a cut recorded in ``text`` is applied again without it) and draw its figures again in
    ``figures_dir``."""
    exp = EXPERIMENTS[name]
    df = pd.read_csv(os.path.join(folder, f"{name}.csv"))
    for col in df.columns:  # text columns: an empty cell was "" when written, not NaN
        if pd.api.types.is_string_dtype(df[col]) or df[col].dtype == object:
            df[col] = df[col].fillna("")
    notes = []
    for key, csv in ATTR_TABLES.get(name, {}).items():
        path = os.path.join(folder, csv)
        if os.path.exists(path):
            df.attrs[key] = pd.read_csv(path)
    intro = None
    if name == "train_drift":
        if "--model llama" in text:  # its arms and corpus live with the arms: read back from the recorded report
            intro = _llama_attrs(folder, df, text, size)
            notes.append("The workload's prose, the sizes and the arms skipped are read back from the recorded "
                         "report; how far each arm got, from the loss CSV.")
            recorded = re.search(re.escape(train_drift_real.CUT).replace(r"\{until\}", r"(\d+)")
                                 .replace(r"\{steps\}", r"\d+"), text)
            at = until if until is not None else int(recorded.group(1)) if recorded else None
            if at is not None:
                df = train_drift_real.cut(df, at)
                if until is not None:
                    exp.figures(df, figures_dir or folder)
        else:
            df.attrs["settings"] = exp.SIZES[size]
    if until is not None and "cut" not in df.attrs:
        raise ValueError(f"until: only a train-drift --model llama run can be cut, not {folder}'s {name}")
    if name == "ring" and _candidates(text):
        df.attrs["candidates"] = _candidates(text)
        notes.append("The candidate causes are read back from the recorded report's table (they were never written "
                     "to a CSV): before, after and factor as printed there.")
    missing = [t for key, t in ATTR_MISSING.get(name, {}).items() if key not in df.attrs]
    if name == "kernels":  # a real kernel whose model the run did not emulate: shown, no verdict
        impls = set(df["impl"])
        missing += [f"rows of `emulated {model}`, the model the current report pairs with `{real}` (so {real} gets "
                    "no verdict)" for real, model in exp.MODELS.items()
                    if real in impls and f"emulated {model}" not in impls]
        if device == "cuda" and "tiles" not in df.attrs:  # a GPU run before the sweep, or without fadev's CUDA
            missing.append("the native tile sweep (fadev's native kernel per forward tile beside its emulation): the "
                           "run predates it or had no CUDA device for fadev, or kernels_tiles.csv was not kept")
    if missing:
        notes.append("Not in the recorded CSVs, so not shown: " + "; ".join(missing) + ".")
    sizes_text, seconds = _sizes_line(text, name)
    if sizes_text is None:
        sizes_text = "as in the recorded run's header above (its report had no sizes line)"
    stems = exp.FIGURES + getattr(exp, "EXTRA_FIGURES", ())  # extra: drawn only where their rows were measured
    figures = [p for stem in stems for p in sorted(glob.glob(os.path.join(folder, f"{stem}.png")))]
    return {"experiment": exp, "df": df, "figures": figures, "findings": exp.findings(df, device=device),
            "seconds": seconds, "sizes_text": sizes_text, "notes": notes, "intro": intro}


def _llama_attrs(folder, df, text, size):
    """Fill ``df.attrs`` of a recorded ``train-drift --model llama`` folder as its run did (settings from the sizes
    line, arms and pairs from the rows, progress from the loss CSV, skipped arms from the report, per-layer rows
    from train_drift_layers.csv); returns the recorded workload prose."""
    from . import train_drift, train_drift_real
    from ..training import Pair
    sizes, _ = _sizes_line(text, "train_drift")
    if sizes is None:
        raise ValueError(f"{folder}: the recorded report has no sizes line to render a llama run from")
    recorded = dict(item.split("=", 1) for item in sizes.split(", "))
    if "kv_heads" in recorded:  # recorded before the setting was spelled heads_kv
        recorded["heads_kv"] = recorded.pop("kv_heads")
    kernels = recorded.get("kernels", "emulated")
    settings = train_drift.settings(size, "llama", kernels=kernels)
    for key, value in recorded.items():
        if key in settings and not isinstance(settings[key], tuple):
            settings[key] = type(settings[key])(float(value)) if isinstance(settings[key], (int, float)) else value
    loss = df.attrs["loss"]
    head_dim = settings["hidden"] // settings["heads"]
    if kernels in train_drift_real.KINDS:
        extra = train_drift_real.EXTRA if kernels == "real" else ()  # the named arms only the real set has
        arms = train_drift_real.runs_and_pairs("cuda", head_dim, ("all",) + extra, kernels)[0]
    else:  # the CPU's arms, and the native ones (which need no GPU to describe) from their names
        from ..training.lm import Arm
        arms = train_drift.llama_runs_and_pairs("cpu", settings["native_tiles"], settings["flash_block"],
                                                head_dim=head_dim)[0]
        for name in dict.fromkeys(loss["run"]):
            tile = re.fullmatch(r"native_(\d+)x(\d+)(?:_again)?", name)
            if tile:
                arms.append(Arm(name, "native", "fa2:bf16", "bf16",
                                tiling={"block_q": int(tile.group(1)), "block_kv": int(tile.group(2))}))
    names = list(dict.fromkeys(loss["run"]))
    pairs = df[["pair", "a", "b", "role"]].drop_duplicates("pair")
    skipped = re.search(r"Skipped arms: (.*)\.\n", text)
    df.attrs.update(settings=settings, runs=[a for a in arms if a.name in names], unit="nats per byte",
                    pairs=[Pair(*row) for row in pairs.itertuples(index=False)], steps=settings["steps"],
                    reached={n: (int(g["step"].max()), float(g["seconds"].sum()))
                             for n, g in loss.groupby("run", sort=False)},
                    skipped=dict(re.findall(r"`([^`]+)` \((.*?)\)(?:; |$)", skipped.group(1))) if skipped else {})
    layers = os.path.join(folder, "train_drift_layers.csv")
    if os.path.exists(layers):
        df.attrs["layers"] = pd.read_csv(layers)
    match = re.search(r"\n## \d+\. [^\n]*\n\n(.*?)\n\nSizes \(`", text, re.S)
    return match.group(1) if match else None


def reports(folder):
    """[(recorded report path, [experiment names])] of a results folder: DIR/report.md with every experiment
    whose NAME.csv is there, else one DIR/NAME.md per experiment (a folder of separate runs, e.g. ring-dist and
    ring-multigpu side by side). ValueError where there is no experiment CSV or no recorded report."""
    names = [n for n in EXPERIMENTS if os.path.exists(os.path.join(folder, f"{n}.csv"))]
    if not names:
        raise ValueError(f"report: no experiment CSV (one of {', '.join(n + '.csv' for n in EXPERIMENTS)}) in {folder}")
    if os.path.exists(os.path.join(folder, "report.md")) or len(names) == 1:
        return [(_recorded_text(folder, names)[0], names)]
    own = [(os.path.join(folder, f"{n}.md"), [n]) for n in names if os.path.exists(os.path.join(folder, f"{n}.md"))]
    if len(own) != len(names):
        raise ValueError(f"report: {folder} has no report.md and not one NAME.md per experiment CSV ({', '.join(names)})")
    return own


def rerender(folder, out=None, size=None, until=None):
    """Render DIR's report again from DIR/NAME.csv of every experiment found there; writes ``out`` (default:
    the recorded report's path, replaced) and returns (path, results). ``size``: "quick" or "full" (default:
    as the recorded report says). A folder with one report per experiment (:func:`reports`) gets each rendered
    again in its own file: ``out`` is then a folder (default: DIR) and the path returned is a list of paths.
    ``until``: cut a train-drift --model llama run at that update (train_drift_real.cut: for a run whose lease
    ended before every arm was done), its figures drawn again beside the report; the report records the cut, so
    later renderings keep it."""
    groups = reports(folder)
    if len(groups) == 1:
        return _render(folder, groups[0][0], groups[0][1], out, size, until)
    if until is not None:
        raise ValueError(f"until: only a train-drift --model llama run can be cut, not the experiments of {folder}")
    paths, results = [], {}
    for path, names in groups:
        target = os.path.join(out, os.path.basename(path)) if out else None
        if out:
            os.makedirs(out, exist_ok=True)
        done, found = _render(folder, path, names, target, size)
        paths.append(done)
        results.update(found)
    return paths, results


def _render(folder, path, names, out, size, until=None):
    with open(path) as fh:
        text = fh.read()
    size = size or _size(text, folder)
    if size not in ("quick", "full"):
        raise ValueError(f"size must be 'quick' or 'full', got {size!r}")
    header = _header(text)
    device = "cuda" if re.search(r"cuda|GPU", header) else "cpu"
    target = os.path.dirname(out) if out else folder
    results = {n: _result(folder, n, size, device, text, until, target) for n in names}
    if len(names) == 1:
        command = names[0].replace("_", "-")
        title = f"{EXPERIMENTS[names[0]].TITLE} (`python -m fadev {command}`)"
        recorded = text.split("\n", 1)[0].removeprefix("# ")
        if recorded.startswith(title[:-2]):  # the recorded command named its workload (train-drift --model llama)
            title = recorded
    else:
        title = f"Reproducing {PAPER} with fadev"
    csvs = [f"{n}.csv" for n in names] + [c for n in names for c in ATTR_TABLES.get(n, {}).values()
                                          if os.path.exists(os.path.join(folder, c))]
    rendered = (f"Re-rendered from the recorded CSVs ({', '.join(csvs)}) by `python -m fadev "
                f"report DIR` (fadev {__version__}, {datetime.date.today().isoformat()}): the numbers are the "
                f"recorded run's, the findings and tables are computed from them by the current code.")
    if any("cut" in r["df"].attrs for r in results.values()):
        rendered += " The run is read up to the update it was cut at (below); its figures are drawn from those rows."
    sampled = any("n_query" in r["experiment"].SIZES[size] for r in results.values())
    report.write(out or path, results, title=title, command="python -m fadev report DIR", size=size,
                 header=[f"Recorded run: {header}", rendered], preamble=[METHOD] if sampled else [],
                 headline=headline(results))
    return out or path, results


__all__ = ["rerender", "reports", "ATTR_TABLES", "ATTR_MISSING"]
