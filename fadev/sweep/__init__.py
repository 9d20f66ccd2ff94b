"""Parameter sweeps: run many attention configurations, one result row per point, resumably.

A *point* is a flat dict of parameters (:data:`PARAMS`; every one has a default). Each point draws
inputs (``batch``, ``heads``, ``N``, ``D``, ``dist``, ``seed``, ...), runs the *test* attention
(``kernel`` under ``policy`` with its tiling) and compares its output with the references the point
names: ``golden`` (baseline under ``Policy.golden()`` on the same inputs, cached per input within a
process) and optionally a second run ``ref_kernel`` / ``ref_policy`` / ``ref_block_kv`` ... . The paper's::

    {"kernel": "flash", "policy": "paper:bf16", "ref_kernel": "baseline", "ref_policy": "naive:bf16",
     "N": 1024, "D": 64, "seed": 0}

Per-stage overrides: ``"stage.p": "fp32"`` (or ``"override": {"p": "fp32"}``), ``"ref_stage.p"``.
Free labels: ``"tag.NAME": value`` (part of the point). Inputs are rounded to ``input_fmt`` (default:
the test policy's input format) before golden and every run, so the errors are the kernels' own.

A row (flat dict / DataFrame row) holds:

* ``key``: hash of the point (:func:`point_key`); every parameter of :data:`PARAMS`, canonical (None
  where it does not apply, e.g. tiles of a baseline run), then ``stage.*``, ``ref_stage.*``, ``tag.*``;
* ``policy_name`` / ``ref_policy_name`` (e.g. "paper(bf16)+p=fp32") and the flash parameters the run
  really used, ``used.block_q``, ``used.block_kv``, ``used.loop_order``, ``used.normalize``,
  ``used.exp`` (``ref_used.*``; None for baseline);
* per compared pair, ``PAIR.n``, ``PAIR.n_nan``, ``PAIR.n_inf`` and ``PAIR.METRIC`` for each of
  :data:`METRICS` (a :class:`fadev.Comparison`), PAIR = ``vs_golden`` (test - golden), ``vs_ref``
  (test - ref), ``ref_vs_golden`` (ref - golden), and with ``lse=True`` the same of the log-sum-exp as
  ``lse_vs_golden``, ``lse_vs_ref``, ``lse_ref_vs_golden``;
* ``test_s`` (seconds in the test kernel), ``wall_s`` (the whole point) and ``fadev_version``; timings
  are the only columns that vary between runs.

:func:`point_from_row` gives the point back; :func:`evaluate` on it reproduces the metrics bit for bit.
:func:`run` validates every point first (one ValueError listing every problem), appends each row to a
JSON Lines or CSV file as it finishes (flushed and fsynced; only the calling process writes it), skips
points already in the file, and spreads points over an executor: local worker processes, Ray tasks on a
cluster (``executor="ray"``, ``address=``) or any ``concurrent.futures.Executor``; a point that raises
becomes a row with its ``error`` (retried by the next run) instead of stopping the sweep. :func:`load`,
:func:`aggregate` (mean/std/count over seeds) and :func:`export` (CSV, Parquet) read results back.
``python -m fadev sweep CONFIG.toml`` runs a TOML config (:func:`fadev.sweep.cli.load_config`).

The package: :mod:`~fadev.sweep.schema` (parameters, validation, canonical form, keys, grids, the kernel
table), :mod:`~fadev.sweep.evaluation` (one point -> one row), :mod:`~fadev.sweep.running` (many points,
resuming; aggregation), :mod:`~fadev.sweep.executors` (local processes, Ray, any Executor),
:mod:`~fadev.sweep.results` (the results file), :mod:`~fadev.sweep.cli` (``python -m fadev sweep``).
"""
from __future__ import annotations

from .evaluation import evaluate, point_from_row
from .executors import MAX_RETRIES
from .results import ResultsFile, export, frame, load
from .running import aggregate, drive, run
from .schema import KERNELS, MAX_SEQ, METRICS, PARAMS, PRESETS, canonical, expand, point_key, validate

__all__ = ["PARAMS", "METRICS", "PRESETS", "KERNELS", "MAX_SEQ", "expand", "canonical", "validate", "point_key",
           "evaluate", "point_from_row", "run", "drive", "MAX_RETRIES", "load", "export", "aggregate", "ResultsFile",
           "frame"]
