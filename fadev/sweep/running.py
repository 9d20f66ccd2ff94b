"""Running a sweep: every point validated first, rows appended to a results file as points finish,
finished points skipped on a rerun, points spread over an executor (:func:`run`, :func:`drive`); and
:func:`aggregate` (mean/std/count over seeds) of the rows."""
from __future__ import annotations

import os

from .evaluation import _input_fmt, evaluate
from .executors import check, execute
from .results import ResultsFile, frame
from .schema import _PREFIXES, METRICS, PARAMS, point_key, validate

# ------------------------------------------------------------------ running

def _golden_group(p):
    return (p["batch"], p["heads"], repr(p["heads_kv"]), p["N"], repr(p["N_kv"]), p["D"], p["dist"], p["seed"],
            _input_fmt(p), p["causal"], repr(p["scale"]))


def run(points, out=None, *, executor="local", workers=None, address=None, gpus_per_point=None, progress=True):
    """Run a sweep; returns its rows as a DataFrame in the order of ``points`` (one per distinct point).

    ``points``: a list of point dicts (see :func:`expand`), all validated before any work starts (one
    ValueError listing every problem). ``out``: a .jsonl or .csv file; only this (the driver) process
    writes it: each row is appended, flushed and fsynced as its point finishes, and points whose key is
    already in the file are skipped (their rows are read back), so an interrupted sweep loses nothing and
    a rerun resumes it.

    ``executor`` (:mod:`fadev.sweep.executors`): "local" runs the points here (``workers`` 1, the
    default) or in ``workers`` spawned processes (one kernel thread each); "ray" runs one Ray task per
    chunk of points on the Ray instance at ``address`` (None: a local one with ``workers`` CPUs; "auto" or
    "ray://host:port": a cluster), points on device "cuda" asking for ``gpus_per_point`` GPUs (default 1;
    fractions share a GPU); or any ``concurrent.futures.Executor`` (e.g. Dask's
    ``client.get_executor()``). Whichever runs them, the rows' metrics are the same bits. Spawned local
    workers import the calling script: guard its top level with ``if __name__ == "__main__":``.

    A point that raises gives a *failed row* (its parameters and ``error``) and the sweep goes on; a rerun
    retries failed points (their old rows are removed from the file first). A chunk whose worker died is
    retried a few times (:data:`~fadev.sweep.executors.MAX_RETRIES`). ``progress``: a tqdm bar with ETA
    on stderr, advancing as rows arrive.
    """
    canon = validate(points)
    keys = [point_key(p) for p in canon]
    unique = dict(zip(keys, canon))
    rows = drive(unique, evaluate, point_key, out, group=_golden_group, progress=progress, executor=executor,
                 workers=workers, address=address, gpus_per_point=gpus_per_point)
    return frame([rows[k] for k in unique])


def drive(points, fn, key, out, *, group=None, progress=True, desc="sweep", **options):
    """Run ``points`` ({key: point}) through ``fn`` (point -> row dict holding "key") on an executor
    (``options``: executor, workers, address, gpus_per_point; :func:`fadev.sweep.executors.execute`),
    appending each row to ``out`` (None: no file) as it arrives and skipping the keys finished there;
    rows of failed points in ``out`` are removed and those points run again. Returns {key: row}.
    ``fn``, ``key`` and ``group`` (point -> a sortable key; points of one group run together) must be
    module-level functions (picklable) for executors in other processes."""
    check(options.get("executor", "local"), options.get("workers"), options.get("address"),
          options.get("gpus_per_point"))
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out must be the path of a .jsonl or .csv results file (or None), got {type(out).__name__} "
                        f"{out!r}")
    file = ResultsFile(out) if out is not None else None
    try:
        done = {}
        if file is not None:
            old = {r["key"]: r for r in file.typed_rows()}
            failed = {k for k, r in old.items() if r.get("error") is not None}
            if failed:
                file.drop(failed)
            done = {k: r for k, r in old.items() if k in points and k not in failed}
        todo = [k for k in points if k not in done]
        if group is not None:
            todo.sort(key=lambda k: group(points[k]))  # stable: shared inputs run together (golden cache)
        from tqdm import tqdm
        bar = tqdm(total=len(points), initial=len(points) - len(todo), disable=not progress, desc=desc,
                   unit="pt", dynamic_ncols=True)
        try:
            work = execute([points[k] for k in todo], fn, key, group or _no_group, **options) if todo else ()
            for rows in work:  # nothing to do starts no executor (no Ray instance)
                for row in rows:
                    if file is not None:
                        file.append(row)
                    done[row["key"]] = row
                bar.update(len(rows))
        finally:
            bar.close()
    finally:
        if file is not None:
            file.close()
    return done


def _no_group(p):
    return 0


def aggregate(df, by=None, metrics=None):
    """Mean, sample standard deviation (ddof=1) and count of each metric over the rows of each group
    of ``by`` (e.g. over seeds, for error bars). Returns one row per group (first-seen order): the
    ``by`` columns, ``rows`` (rows in the group) and ``METRIC.mean``, ``METRIC.std``, ``METRIC.count``.

    Defaults: ``by`` every parameter column except seed, rounding_seed, ref_rounding_seed (stage and
    tag columns included); ``metrics`` every float metric column (``vs_golden.max_abs`` ...). None/NaN
    parameter values form groups of their own. A NaN metric (a run that overflowed) is not skipped: it
    makes its group's mean and std NaN; ``count`` counts the non-NaN values (so count < rows shows it).
    """
    import pandas as pd
    if metrics is None:
        metrics = [c for c in df.columns if "vs_" in c and c.rsplit(".", 1)[-1] in METRICS]
    if by is None:
        skip = ("seed", "rounding_seed", "ref_rounding_seed")
        by = [c for c in df.columns if (c in PARAMS or c.startswith(_PREFIXES)) and c not in skip]
    by, metrics = list(by), list(metrics)
    missing = [c for c in by + metrics if c not in df.columns]
    if missing:
        raise ValueError(f"aggregate: no column(s) {', '.join(map(repr, missing))} in the results; columns: "
                         f"{', '.join(map(str, df.columns))}")
    values = df[metrics].apply(pd.to_numeric, errors="coerce")
    keys = df[by].astype(object).where(df[by].notna(), None)
    frame = pd.concat([keys, values], axis=1)
    frame["_one"] = 1
    grouped = frame.groupby(by if by else [0] * len(frame), dropna=False, sort=False)
    size = grouped["_one"].sum()
    count = grouped[metrics].count()
    mean = grouped[metrics].mean().where(count.eq(size, axis=0))
    std = grouped[metrics].std().where(count.eq(size, axis=0))
    out = pd.DataFrame(index=size.index)
    out["rows"] = size
    for m in metrics:
        out[f"{m}.mean"], out[f"{m}.std"], out[f"{m}.count"] = mean[m], std[m], count[m]
    return out.reset_index(drop=not by).infer_objects()


# ------------------------------------------------------------------ configs and the command line
