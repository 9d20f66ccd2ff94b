"""Training-drift runs as independent tasks: each run (arm) trains alone on an executor -- a Ray task with
one GPU on device "cuda", a local process, any ``concurrent.futures.Executor`` (fadev.sweep.executors) --
and hands back its weights and losses at every logged step; the driver then compares the pairs at those
checkpoints and writes the same rows as :func:`fadev.training.track`'s lockstep run, bit for bit
(timings aside): a run's trajectory depends only on its own spec, the config and the step (init seed,
data order, deterministic kernels), not on the runs beside it.

Resume: rows already in ``out`` are kept and not written again; runs are not checkpointed, so a driver
killed before every arm finished retrains the arms from step 0 on the next call.
"""
from __future__ import annotations

import os

import torch

from .. import sweep
from ..sweep.results import ResultsFile
from . import digits
from .tracker import (TrainConfig, _Run, _validate, config_key, deterministic, drift_row, frames, loss_row,
                      rows_of)


class _Arm:
    """point {"run": name, "device": device} -> {"key": name, "steps": {step: (weights, train_loss, eval_loss,
    seconds)}}: one run trained alone (a plain class: it pickles for executors in other processes)."""

    def __init__(self, config, specs, device):
        self.config, self.specs, self.device = config, specs, device

    def __call__(self, point):
        config, device = self.config, self.device
        if device == "cuda":  # torch's deterministic cuBLAS needs it (check_device sets it on the driver only)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        train_x, train_y, eval_x, eval_y = digits.load()
        eval_x, eval_y = eval_x[:config.eval_images].to(device), eval_y[:config.eval_images].to(device)
        logged = {}
        with deterministic():
            run = _Run(self.specs[point["run"]], config, device)

            def log_step(step):
                state = {k: v.detach().cpu().numpy().copy() for k, v in run.model.state_dict().items()}
                logged[step] = (state, run.loss_sum / run.loss_n if run.loss_n else None,
                                run.eval_loss(eval_x, eval_y), run.seconds)
                run.reset()

            log_step(0)
            for step in range(config.steps):
                idx = torch.from_numpy(digits.batch_indices(step, config.batch, len(train_x), config.data_seed))
                run.train_step(train_x[idx].to(device), train_y[idx].to(device))
                if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                    log_step(step + 1)
        return {"key": point["run"], "steps": logged}


def _run_name(point):
    return point["run"]


def track_tasks(config, runs, pairs, out=None, device="cpu", log=None, progress=False, **options):
    """:func:`fadev.training.track`'s rows with each run trained as an independent task on an executor
    (``options``: executor, workers, address, gpus_per_point of :func:`fadev.sweep.run`; a run on "cuda"
    asks Ray for one GPU unless gpus_per_point says otherwise). Returns (drift, loss) DataFrames."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config: expected a TrainConfig, got {type(config).__name__}")
    runs, pairs = _validate(runs, pairs)
    key = config_key(config, runs, pairs)
    file = ResultsFile(out) if out is not None else None
    try:
        rows = rows_of(file, key)
        done = {r["key"] for r in rows}
        steps = sorted({0, config.steps, *range(config.log_every, config.steps, config.log_every)})
        wanted = [f"{key}/{s}/{kind}" for s in steps for kind in
                  [f"pair/{p.name}" for p in pairs] + [f"run/{r.name}" for r in runs]]
        if any(k not in done for k in wanted):
            points = {r.name: {"run": r.name, "device": device} for r in runs}
            arms = sweep.drive(points, _Arm(config, {r.name: r for r in runs}, device), _run_name, None,
                               progress=progress, desc="train-drift runs", **options)
            failed = [f"{name}: {a['error']}" for name, a in arms.items() if a.get("error")]
            if failed:
                raise RuntimeError("training run(s) failed: " + "; ".join(failed))
            for step in steps:
                new = [drift_row(key, step, p, arms[p.a]["steps"][step][0], arms[p.b]["steps"][step][0])
                       for p in pairs]
                new += [loss_row(key, step, r.name, *arms[r.name]["steps"][step][1:]) for r in runs]
                for row in new:
                    if row["key"] not in done:
                        if file is not None:
                            file.append(row)
                        done.add(row["key"])
                        rows.append(row)
                if log is not None:
                    log(f"step {step}/{config.steps}: compared {len(pairs)} pairs")
    finally:
        if file is not None:
            file.close()
    return frames(rows, key, config.steps)


__all__ = ["track_tasks"]
