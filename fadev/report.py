"""Markdown reports of experiments: a summary of every claim with a verdict, then one section per experiment.

:func:`write` renders whatever experiments it is given, knowing none of them: each result carries its
experiment (a module of :mod:`fadev.experiments`, with ``TITLE``, ``INTRO``, ``SIZES`` and ``table(df)``),
its DataFrame, figure paths, findings and seconds. :func:`table` and :func:`escape` are the helpers the
experiments use to build their tables.
"""
from __future__ import annotations

import datetime
import os
import platform

import numpy as np

from . import __version__


def _cell(row, col, style):
    if style == "s":
        v = row.get(col, "")
        return "" if v is None or (isinstance(v, float) and np.isnan(v)) else str(v)
    if style in ("pm", "pmx"):
        m, s = row.get(f"{col}.mean", np.nan), row.get(f"{col}.std", np.nan)
        if m is None or not np.isfinite(m):
            return "n/a"
        body = f"{m:.3g}x" if style == "pmx" else f"{m:.3e}"
        return body + (f" ± {s:.1e}" if s is not None and np.isfinite(s) and s > 0 else "")
    v = row.get(col, row.get(f"{col}.mean", np.nan))
    if v is None or (isinstance(v, float) and not np.isfinite(v)):
        return "n/a" if style != "%" else ""
    if style == "d":
        return str(int(v))
    if style == "x":
        return f"{v:.3g}x"
    if style == "%":
        return f"{v:.0%}"
    if style == "e6":
        return f"{v:.6e}"
    return f"{v:.3e}"


def table(df, columns) -> str:
    """A Markdown table of df's rows with the given (column, header, style) columns. A column names a
    DataFrame column or, for styles "pm" (mean ± std, scientific) and "pmx" (mean ± std, a ratio), the
    stem of its ``.mean`` / ``.std`` columns; other styles: "s" text, "d" integer, "x" ratio, "%"
    percentage, "e6" six digits, anything else three."""
    head = "| " + " | ".join(escape(h) for _, h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, rule]
    for row in df.to_dict("records"):
        lines.append("| " + " | ".join(escape(_cell(row, c, s)) for c, _, s in columns) + " |")
    return "\n".join(lines)


def escape(text) -> str:
    """Text for a Markdown table cell: pipes escaped."""
    return str(text).replace("|", "\\|")


def write(path, results, *, title, command, size="quick", device="cpu", device_note="", preamble=()):
    """Write a Markdown report to ``path``; returns the path.

    ``results``: {name: {"experiment": module, "df", "figures", "findings", "seconds"}} in section order, with
    optionally "sizes" (the parameters used; default: the experiment's SIZES[size]).
    ``title``: the document's heading; ``command``: the command that regenerates it (with DIR for the
    output folder); ``device_note``: text after the device (e.g. " (PyTorch sees a GPU)"); ``preamble``:
    paragraphs before the summary."""
    out_dir = os.path.dirname(os.path.abspath(path))
    total = sum(r["seconds"] for r in results.values())
    lines = [f"# {title}", "",
             f"fadev {__version__}, `{size}` sizes, device `{device}`{device_note}; {platform.machine()} "
             f"{platform.system()}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
             f"{datetime.date.today().isoformat()}; {total:.0f} s in this invocation (finished points are read back, "
             f"not recomputed). Regenerate with `{command}`.", ""]
    for paragraph in preamble:
        lines += [paragraph, ""]
    verdicts = [(name, f) for name, r in results.items() for f in r["findings"] if f.holds is not None]
    if verdicts:
        lines += ["## Summary of the claims", "", "| experiment | claim | ours | paper | verdict |",
                  "|---|---|---|---|---|"]
        for name, f in verdicts:
            lines.append(f"| {name} | {escape(f.claim)} | {escape(f.ours)} | {escape(f.paper)} | "
                         f"{'holds' if f.holds else '**does not hold**'} |")
        lines.append("")
    for i, (name, r) in enumerate(results.items(), 1):
        lines += section(i, name, r, size, out_dir)
    with open(path, "w") as fh:
        fh.write("\n".join(lines))
    return path


def section(number, name, result, size, out_dir) -> list:
    """The lines of one experiment's section: title, prose, sizes, figures, findings, table."""
    exp = result["experiment"]
    sizes = result.get("sizes", exp.SIZES[size])
    lines = [f"## {number}. {exp.TITLE}", "", exp.INTRO, "",
             f"Sizes (`{size}`): " + ", ".join(f"{k}={_short(v)}" for k, v in sizes.items()) +
             f". Raw rows: `{name}.jsonl`; this table: `{name}.csv`; {result['seconds']:.1f} s.", ""]
    for fig in result["figures"]:
        if fig.endswith(".png"):
            lines += [f"![{os.path.basename(fig)}]({os.path.relpath(fig, out_dir)})", ""]
    lines += ["Findings:", ""] + [f.markdown() for f in result["findings"]] + [""]
    text = exp.table(result["df"])
    return lines + ([text, ""] if text else [])


def _short(v):
    if isinstance(v, (tuple, list)):
        if len(v) > 4 and all(isinstance(x, int) for x in v):
            return f"{v[0]}..{v[-1]} ({len(v)} values)"
        return "/".join(map(str, v))
    return str(v)


__all__ = ["write", "section", "table", "escape"]
