"""Markdown reports of experiments: a summary of every claim with a verdict, then one section per experiment.

The summary has one table per source of the claims (:data:`SOURCES`: Golden et al., FlashAttention-3,
fadev's checks of its own emulation), each with its count of claims that hold (:func:`counts`).

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


SOURCES = {"golden": "Claims of Golden et al. (arXiv 2405.02803)",
           "fa3": "Claims of FlashAttention-3 (arXiv 2407.08608)",
           "fadev": "fadev's checks of its emulation (against real kernels, and its own invariances)"}
"""Where a verdict's claim comes from: {key: the heading of its summary table}, in summary order."""


def counts(findings) -> dict:
    """{source: (claims that hold, claims that partly hold, claims with a verdict)} over ``findings`` for every
    source of :data:`SOURCES` (0, 0, 0 where none); a finding with a verdict must name one of them."""
    out = {src: [0, 0, 0] for src in SOURCES}
    for f in findings:
        if f.holds is None:
            continue
        if f.source not in SOURCES:
            raise ValueError(f"finding {f.claim!r}: source must be one of {', '.join(SOURCES)}, got {f.source!r}")
        out[f.source][0] += bool(f.holds)
        out[f.source][1] += bool(getattr(f, "partly", ""))
        out[f.source][2] += 1
    return {src: tuple(v) for src, v in out.items()}


def tally(ok, partly, n) -> str:
    """"5 of 7 hold" or, where some claims hold on part of their range, "5 of 7 hold, 1 partly"."""
    return f"{ok} of {n} hold" + (f", {partly} partly" if partly else "")


def count_line(findings) -> str:
    """One line with every source's count: "Golden et al.: 5 of 7 hold, 1 partly; ..." (the CLI's summary);
    sources without a verdict in ``findings`` are left out ("no claim with a verdict" where none has one)."""
    names = {"golden": "Golden et al.", "fa3": "FlashAttention-3", "fadev": "fadev's checks"}
    parts = [f"{names[src]}: {tally(*c)}" for src, c in counts(findings).items() if c[2]]
    return "; ".join(parts) or "no claim with a verdict in this run"


def summary(results) -> list:
    """The summary's lines: one table per source with its count ("N of M hold"), rows per verdict; a source
    without a verdict in this run gets its heading and one line saying so."""
    found = [(name, f) for name, r in results.items() for f in r["findings"]]
    numbers = counts([f for _, f in found])
    lines = ["## Summary of the claims", ""]
    for src, title in SOURCES.items():
        rows = [(name, f) for name, f in found if f.holds is not None and f.source == src]
        if not rows:
            lines += [f"### {title}", "", "(none measured in this run)", ""]
            continue
        lines += [f"### {title}: {tally(*numbers[src])}", ""]
        lines += ["| experiment | claim | ours | claimed | verdict |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {escape(f.claim)} | {escape(f.ours)} | {escape(f.paper)} | "
                  f"{f.verdict if f.holds else '**' + f.verdict + '**'} |" for name, f in rows]
        lines.append("")
    return lines


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


def write(path, results, *, title, command, size="quick", device="cpu", device_note="", preamble=(), header=None,
          headline=()):
    """Write a Markdown report to ``path``; returns the path.

    ``results``: {name: {"experiment": module, "df", "figures", "findings", "seconds"}} in section order, with
    optionally "sizes" (the parameters used; default: the experiment's SIZES[size]), "sizes_text" (the sizes
    as text, instead) and "notes" (paragraphs printed after the sizes).
    ``title``: the document's heading; ``command``: the command that regenerates it (with DIR for the
    output folder); ``device``: where the run happened, as text (e.g. "CPU (asked for cuda: no GPU)");
    ``device_note``: text after it; ``preamble``: paragraphs before the summary; ``header``: paragraphs in
    place of the line on this run (version, sizes, machine, date, seconds), for a report re-rendered from a
    recorded run; ``headline``: paragraphs right under the title, before the line on this run (the findings in
    short). A result's optional "ran_on" (text) is printed in its section."""
    out_dir = os.path.dirname(os.path.abspath(path))
    total = sum(r["seconds"] for r in results.values())
    lines = [f"# {title}", ""]
    for paragraph in headline:
        lines += [paragraph, ""]
    if header is None:
        lines += [f"fadev {__version__}, `{size}` sizes, ran on: {device}{device_note}; {platform.machine()} "
                  f"{platform.system()}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
                  f"{datetime.date.today().isoformat()}; {total:.0f} s in this invocation (finished points are read "
                  f"back, not recomputed). Regenerate with `{command}`.", ""]
    else:
        for paragraph in header:
            lines += [paragraph, ""]
    for paragraph in preamble:
        lines += [paragraph, ""]
    lines += summary(results)
    for i, (name, r) in enumerate(results.items(), 1):
        lines += section(i, name, r, size, out_dir)
    with open(path, "w") as fh:
        fh.write("\n".join(lines))
    return path


def section(number, name, result, size, out_dir) -> list:
    """The lines of one experiment's section: title, prose, sizes, figures, findings, table."""
    exp = result["experiment"]
    sizes = result.get("sizes_text") or ", ".join(f"{k}={_short(v)}" for k, v in result.get("sizes", exp.SIZES[size]).items())
    seconds = result["seconds"]
    lines = [f"## {number}. {exp.TITLE}", "", result.get("intro") or exp.INTRO, "",
             f"Sizes (`{size}`): {sizes}. Raw rows: `{name}.jsonl`; this table: `{name}.csv`" +
             (f"; {seconds:.1f} s" if np.isfinite(seconds) else "") +
             (f"; ran on: {result['ran_on']}." if result.get("ran_on") else "."), ""]
    for note in result.get("notes", ()):
        lines += [note, ""]
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


__all__ = ["SOURCES", "counts", "tally", "count_line", "summary", "write", "section", "table", "escape"]
