"""The Llama training-drift study's driver: arms (:class:`fadev.training.lm.Arm`) trained as independent,
resumable tasks, compared at their logged steps into the rows of :mod:`fadev.training.tracker`.

Rounds. Every arm advances to the same next multiple of ``checkpoint_every`` (each arm a task on
fadev.sweep's executors: in this process, local worker processes, Ray -- one GPU per arm on "cuda" unless
``gpus_per_point`` shares them); after each round the driver compares every pair at the logged steps both
of its arms have reached (:func:`fadev.weights.model_distance` of the two snapshots), writes the drift and
loss rows (one results file, appended and fsynced, keyed: never duplicated), and deletes the snapshots
no pair needs any more. So the arms stay within a round of each other and a stop at any moment leaves
comparable arms.

GPUs. On device "cuda" the arms are spread over every GPU this process sees (arm i on GPU i mod count, each arm
a process of its own: ``workers`` defaults to one per arm there), and the driver compares the snapshots on its
GPU (fadev's GPU metrics). Each comparison also gives one row per layer (:func:`fadev.training.lm.layer_of`),
``drift.attrs["layers"]``.

Budget. ``budget_s``: no round starts and no update begins that would end past it (each task stops
before an update when twice its slowest update plus a save would cross the deadline), and every arm is
saved where it stopped; the next call continues from there. Between calls the output folder is the whole
state (``train_drift.jsonl``, ``train_drift_arms/NAME/``): copy it to continue on another machine with the
same corpus (its fingerprint is part of the configuration key, checked on resume).
"""
from __future__ import annotations

import math
import os
import time

from ..sweep.executors import execute
from ..sweep.results import ResultsFile
from . import lm, text
from .tracker import _validate, drift_rows, frames, layer_frame, loss_row, rows_of

ARMS_DIR = "train_drift_arms"


def _run_name(point):
    return point["run"]


def _one_group(point):
    return 0


def _snapshots_needed(config, pairs, done, key):
    """{(arm, step)} whose snapshot a missing drift row still needs."""
    need = set()
    for step in config.logged_steps():
        for p in pairs:
            if f"{key}/{step}/pair/{p.name}" not in done:
                need |= {(p.a, step), (p.b, step)}
    return need


def track_arms(config, arms, pairs, out, *, device="cpu", budget_s=None, log=None, progress=False,
               executor="local", workers=None, address=None, gpus_per_point=None):
    """Train ``arms`` for ``config.steps`` updates as independent resumable tasks and log the distances of
    ``pairs`` and each arm's losses at the logged steps (module docstring). ``out``: the output folder
    (``train_drift.jsonl`` and ``train_drift_arms/``); ``budget_s``: seconds this call may train (None: no
    limit). Returns (drift, loss, reached): the DataFrames of every row of this configuration (earlier
    calls' included) and {arm: (updates done, seconds those updates took)}."""
    if not isinstance(config, lm.LMConfig):
        raise TypeError(f"config: expected an LMConfig, got {type(config).__name__}")
    arms, pairs = _validate(arms, pairs)
    for a in arms:
        if not isinstance(a, lm.Arm):
            raise TypeError(f"arms: expected fadev.training.lm.Arm objects, got {type(a).__name__}")
    if budget_s is not None and not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise ValueError(f"budget_s must be a positive number of seconds or None, got {budget_s!r}")
    deadline = time.time() + budget_s if budget_s is not None and math.isfinite(budget_s) else None
    say = log or (lambda line: None)
    corpus = text.load(config.data)
    text.check(corpus, config.seq)
    key = lm.study_key(config, arms, pairs, corpus.fingerprint)
    root = os.path.join(out, ARMS_DIR)
    os.makedirs(root, exist_ok=True)
    by_name = {a.name: a for a in arms}
    task = lm.ArmTask(config, by_name, key, root, deadline)
    gpus = {}
    if device == "cuda" and executor != "ray":  # Ray pins its GPU tasks itself
        import torch
        count = max(1, torch.cuda.device_count())
        gpus = {a.name: i % count for i, a in enumerate(arms)}
        if workers is None and executor == "local":
            workers = len(arms)
    file = ResultsFile(os.path.join(out, "train_drift.jsonl"))
    try:
        rows = rows_of(file, key)
        done = {r["key"] for r in rows}
        state = {a.name: lm.read_progress(root, a.name, key) for a in arms}
        compare(config, pairs, key, root, state, file, rows, done, device)
        while True:
            low = min(s["step"] for s in state.values())
            if low >= config.steps or (deadline is not None and time.time() >= deadline):
                break
            until = min(config.steps, (low // config.checkpoint_every + 1) * config.checkpoint_every)
            points = [{"run": a.name, "until": until, "device": device, **({"gpu": gpus[a.name]} if gpus else {})}
                      for a in arms if state[a.name]["step"] < until]
            say(f"round to update {until}: {', '.join(p['run'] for p in points)}")
            before = {n: s["step"] for n, s in state.items()}
            for chunk in execute(points, task, _run_name, _one_group, executor=executor, workers=workers,
                                 address=address, gpus_per_point=gpus_per_point):
                for r in chunk:
                    if r.get("error"):
                        raise RuntimeError(f"arm {r['run']!r} failed: {r['error']}")
                    state[r["key"]] = {"step": r["step"], "log": {int(s): v for s, v in r["log"].items()},
                                       "train_s": r["train_s"]}
            compare(config, pairs, key, root, state, file, rows, done, device)
            say("reached: " + ", ".join(f"{n} {s['step']} ({s['train_s'] / max(1, s['step']):.3g} s/update)"
                                        for n, s in state.items()))
            if all(state[n]["step"] == before[n] for n in state):
                break  # the deadline stopped every arm before its next update
    finally:
        file.close()
    drift, loss = frames(rows, key, config.steps)
    drift.attrs["layers"] = layer_frame(rows, key, config.steps)
    return drift, loss, {n: (s["step"], s["train_s"]) for n, s in state.items()}


def compare(config, pairs, key, root, state, file, rows, done, device="cpu"):
    """Append the loss rows of every logged step the arms report and the drift rows of every pair both of
    whose arms have reached a logged step; delete the snapshots no missing row needs."""
    def emit(row):
        if row["key"] not in done:
            file.append(row)
            done.add(row["key"])
            rows.append(row)

    for name, s in state.items():
        for step, (train, evl, seconds) in sorted(s["log"].items()):
            emit(loss_row(key, step, name, train, evl, seconds))
    for step in config.logged_steps():
        cache = {}
        for p in pairs:
            if f"{key}/{step}/pair/{p.name}" in done or not all(step in state[n]["log"] for n in (p.a, p.b)):
                continue
            for n in (p.a, p.b):
                if n not in cache:
                    cache[n] = lm.load_snapshot(root, n, step, key, "cuda" if device == "cuda" else "cpu")
            for row in drift_rows(key, step, p, cache[p.a], cache[p.b], lm.layer_of):
                emit(row)
    need = _snapshots_needed(config, pairs, done, key)
    for name, s in state.items():
        for step in s["log"]:
            path = lm.snapshot_path(root, name, step)
            if (name, step) not in need and os.path.exists(path):
                os.remove(path)


__all__ = ["track_arms", "compare", "ARMS_DIR"]
