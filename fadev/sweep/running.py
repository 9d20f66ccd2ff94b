"""Running a sweep: every point validated first, rows appended to a results file as points finish,
finished points skipped on a rerun, points spread over worker processes (:func:`run`); and
:func:`aggregate` (mean/std/count over seeds) of the rows."""
from __future__ import annotations

import concurrent.futures
import multiprocessing

from .. import set_num_threads
from .evaluation import _input_fmt, evaluate
from .results import ResultsFile, frame
from .schema import _PREFIXES, METRICS, PARAMS, point_key, validate

# ------------------------------------------------------------------ running

def _worker_init():
    set_num_threads(1)


def _evaluate_chunk(points):
    return [evaluate(p) for p in points]


def _golden_group(p):
    return (p["batch"], p["heads"], repr(p["heads_kv"]), p["N"], repr(p["N_kv"]), p["D"], p["dist"], p["seed"],
            _input_fmt(p), p["causal"], repr(p["scale"]))


def run(points, out=None, *, workers=1, progress=True):
    """Run a sweep; returns its rows as a DataFrame in the order of ``points`` (one per distinct point).

    ``points``: a list of point dicts (see :func:`expand`), all validated before any work starts (one
    ValueError listing every problem). ``out``: a .jsonl or .csv file; each row is appended, flushed and
    fsynced as its point finishes, and points whose key is already in the file are skipped (their rows
    are read back), so an interrupted sweep loses nothing and a rerun resumes it. ``workers`` > 1 runs
    points in that many spawned processes (one kernel thread each); the results equal a serial run's.
    Spawned workers import the calling script: guard its top level with ``if __name__ == "__main__":``
    (as multiprocessing requires; notebooks and ``python -m fadev sweep`` need nothing).
    ``progress`` shows a tqdm bar with ETA on stderr.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    canon = validate(points)
    keys = [point_key(p) for p in canon]
    order = list(dict.fromkeys(keys))
    unique = dict(zip(keys, canon))
    file = ResultsFile(out) if out is not None else None
    try:
        done = {}
        if file is not None:
            done = {r["key"]: r for r in file.typed_rows() if r.get("key") in unique}
        todo = [k for k in order if k not in done]
        todo.sort(key=lambda k: _golden_group(unique[k]))  # stable: shared inputs run together (golden cache)
        new = {}
        from tqdm import tqdm
        bar = tqdm(total=len(order), initial=len(order) - len(todo), disable=not progress, desc="sweep",
                   unit="pt", dynamic_ncols=True)
        try:
            for row in _execute([unique[k] for k in todo], workers):
                if file is not None:
                    file.append(row)
                new[row["key"]] = row
                bar.update(1)
        finally:
            bar.close()
    finally:
        if file is not None:
            file.close()
    return frame([new.get(k) or done[k] for k in order])


def _execute(points, workers):
    """Yield rows as points finish: in order when serial; chunks of points sharing inputs when parallel."""
    if workers == 1 or len(points) <= 1:
        for p in points:
            try:
                row = evaluate(p)
            except Exception as e:
                raise RuntimeError(f"sweep point failed: {type(e).__name__}: {e}; point: {p!r}") from e
            yield row
        return
    size = max(1, min(8, len(points) // (4 * workers)))
    chunks, current = [], []
    for p in points:
        if current and (len(current) == size or _golden_group(p) != _golden_group(current[0])):
            chunks.append(current)
            current = []
        current.append(p)
    chunks.append(current)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
        futures = {pool.submit(_evaluate_chunk, c): c for c in chunks}
        try:
            for fut in concurrent.futures.as_completed(futures):
                try:
                    rows = fut.result()
                except concurrent.futures.process.BrokenProcessPool as e:
                    raise RuntimeError("a sweep worker process died (killed, out of memory, or the calling script "
                                       "lacks the `if __name__ == '__main__':` guard that spawned workers need "
                                       "to import it safely)") from e
                except Exception as e:
                    raise RuntimeError(f"sweep point failed: {type(e).__name__}: {e}; one of the points: "
                                       f"{futures[fut]!r}") from e
                yield from rows
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


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
