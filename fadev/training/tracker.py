"""Training drift tracker: several training runs advanced in lockstep, the distance between the weights
of named pairs of runs logged every ``log_every`` updates into a resumable results file.

Every run trains :class:`~fadev.training.digits.DigitsTransformer` with the same data order (a function
of ``data_seed`` and the step only), the same optimizer (Adam) and -- unless its ``init_seed`` differs --
the same initial weights; a run's :class:`RunSpec` sets what differs: the attention kernel, policy and
tiling (every SDPA call of the run goes through :func:`fadev.torch.patch_sdpa`), the mixed precision
of the rest of the model, the initialisation seed. Everything is deterministic: one torch thread,
``torch.use_deterministic_algorithms(True)``, no dropout, fadev's kernels bit-reproducible; two runs
with identical specs hold bit-identical weights at every step.

Rows (one results file, :mod:`fadev.sweep.results`: append-only JSON Lines or CSV, each row fsynced):

* ``kind="drift"``: ``step`` (updates done; 0 = the initial weights), ``pair``, ``role``, ``a``, ``b``
  (run names) and the model-level distances of :func:`fadev.weights.compare` (``max_abs``,
  ``wasserstein``, ``rmse``, ``rel_l2``, ``max_abs_tensor``);
* ``kind="loss"``: ``step``, ``run``, ``train_loss`` (mean training cross-entropy, nats per pixel, over
  the updates since the previous logged step; None at step 0), ``eval_loss`` (on the first
  ``eval_images`` held-out images, computed under the run's own attention and precision) and
  ``seconds`` (training time of the run since the previous logged step: the only column that varies
  between identical runs).

Every row carries ``key`` = "CONFIG/STEP/pair|run/NAME" and ``config`` = a hash of the configuration,
the runs and the pairs (not of ``steps``: the trajectory does not depend on where it stops, so a larger
``steps`` extends a finished run).

Resume. After the rows of a logged step are written, the runs' models and optimizer states are saved
to a checkpoint (``out + ".ckpt"``; temp file, fsync, rename), so it always describes a step whose rows
are complete. A run killed at any moment restarts from its last checkpoint, recomputes the updates
after it (deterministically: the same bits) and appends only rows whose key is not in the file yet:
no row is lost, none duplicated, and the file ends equal to an uninterrupted run's, timings aside.
Without a checkpoint (deleted, or ``checkpoint=False``) it recomputes from step 0, skipping logged rows.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
import typing

import torch

from .. import torch as fatorch
from .. import weights
from ..backends import subset
from ..policy import as_policy
from ..sweep.results import ResultsFile, frame
from . import digits

ROLES = ("flash", "init", "precision", "control", "other")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run. ``kernel``: "flash" or "baseline"; ``policy``: a preset spec for
    :func:`fadev.as_policy` ("naive:bf16", "paper:bf16", "fa2:bf16", "golden", ...); ``precision``:
    "fp32", "bf16" or "fp16" mixed precision of the rest of the model (fadev.training.digits);
    ``init_seed``: torch.manual_seed before the model is built; ``tiling``: flash tiling as (name,
    value) pairs, e.g. (("block_q", 16), ("block_kv", 16)). A subclass may allow other kernels and
    precisions (the class attributes below; fadev.training.lm.Arm)."""

    KERNELS: typing.ClassVar[tuple] = subset("flash", "baseline")
    PRECISIONS: typing.ClassVar[tuple] = tuple(digits.PRECISIONS)
    TILED: typing.ClassVar[tuple] = ("flash",)
    """Kernels that take a tiling."""

    name: str
    kernel: str = "baseline"
    policy: str = "naive:bf16"
    precision: str = "bf16"
    init_seed: int = 0
    tiling: tuple = ()

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"run name must be a non-empty string without '/', got {self.name!r}")
        if self.kernel not in self.KERNELS:
            raise ValueError(f"run {self.name!r}: kernel must be {' or '.join(map(repr, self.KERNELS))}, got "
                             f"{self.kernel!r}")
        if not isinstance(self.policy, str):
            raise TypeError(f"run {self.name!r}: policy must be a preset string like 'naive:bf16', got "
                            f"{type(self.policy).__name__}")
        as_policy(self.policy, f"run {self.name!r}: policy")
        if self.precision not in self.PRECISIONS:
            raise ValueError(f"run {self.name!r}: precision must be one of {', '.join(self.PRECISIONS)}, got "
                             f"{self.precision!r}")
        if isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int) or self.init_seed < 0:
            raise ValueError(f"run {self.name!r}: init_seed must be a non-negative int, got {self.init_seed!r}")
        object.__setattr__(self, "tiling", tuple(sorted(tuple(t) for t in dict(self.tiling).items())))
        if self.tiling and self.kernel not in self.TILED:
            raise ValueError(f"run {self.name!r}: tiling needs kernel={' or '.join(map(repr, self.TILED))}, got "
                             f"kernel={self.kernel!r}")

    def label(self) -> str:
        tiles = "".join(f", {k}={v}" for k, v in self.tiling)
        return f"{self.kernel} {as_policy(self.policy).name}{tiles}, {self.precision} model, init seed {self.init_seed}"


@dataclasses.dataclass(frozen=True)
class Pair:
    """Distances of run ``a``'s weights from run ``b``'s (``a - b``; rel_l2 relative to ``b``).
    ``role`` says what the pair measures: "flash" (attention kernel/policy), "init" (initialisation
    seed: the reference drift of an unrelated model), "precision" (low-precision training), "control"
    (identical runs: must stay 0), "other"."""

    name: str
    a: str
    b: str
    role: str = "other"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"pair name must be a non-empty string without '/', got {self.name!r}")
        if self.role not in ROLES:
            raise ValueError(f"pair {self.name!r}: role must be one of {', '.join(ROLES)}, got {self.role!r}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Model and training settings shared by every run. ``steps``: optimizer updates; ``log_every``:
    distances and losses every so many updates (and at 0 and ``steps``); Adam with ``lr``, no weight
    decay, no schedule; ``eval_images``: held-out images for eval_loss (<= 297)."""

    width: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 32
    lr: float = 2e-3
    steps: int = 200
    log_every: int = 10
    data_seed: int = 0
    eval_images: int = 96

    def __post_init__(self):
        for f in ("width", "heads", "layers", "batch", "steps", "log_every", "eval_images"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be a multiple of heads ({self.heads})")
        if self.eval_images > digits.N_EVAL:
            raise ValueError(f"eval_images must be <= {digits.N_EVAL}, got {self.eval_images}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")


UNKEYED = ("steps", "checkpoint_every", "budget_s")
"""Config fields that do not shape the logged trajectory: where it stops, how often it is saved."""


def config_key(config, runs, pairs, **extra) -> str:
    """Hash of everything that shapes the logged trajectory (all of ``config`` but :data:`UNKEYED`; ``extra``:
    more that does, e.g. the training data's fingerprint)."""
    cfg = {k: v for k, v in dataclasses.asdict(config).items() if k not in UNKEYED}
    blob = json.dumps({"config": cfg, "runs": [dataclasses.asdict(r) for r in runs],
                       "pairs": [dataclasses.asdict(p) for p in pairs], "version": 1, **extra}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _validate(runs, pairs):
    runs, pairs = tuple(runs), tuple(pairs)
    if not runs:
        raise ValueError("runs: need at least one RunSpec")
    for r in runs:
        if not isinstance(r, RunSpec):
            raise TypeError(f"runs: expected RunSpec objects, got {type(r).__name__}")
    for p in pairs:
        if not isinstance(p, Pair):
            raise TypeError(f"pairs: expected Pair objects, got {type(p).__name__}")
    names = [r.name for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"runs: duplicate run name(s) {', '.join(dup)}")
    pnames = [p.name for p in pairs]
    dup = sorted({n for n in pnames if pnames.count(n) > 1})
    if dup:
        raise ValueError(f"pairs: duplicate pair name(s) {', '.join(dup)}")
    for p in pairs:
        for side in (p.a, p.b):
            if side not in names:
                raise ValueError(f"pair {p.name!r}: no run named {side!r} (runs: {', '.join(names)})")
    return runs, pairs


@contextlib.contextmanager
def deterministic():
    """One torch thread and deterministic algorithms while inside; the previous settings restored."""
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det)
        torch.set_num_threads(threads)


class _Run:
    """A run's model, optimizer, SDPA patch and loss accumulators."""

    def __init__(self, spec, config, device):
        self.spec = spec
        torch.manual_seed(spec.init_seed)
        self.model = digits.DigitsTransformer(config.width, config.heads, config.layers).to(device)
        self.model.set_precision(spec.precision)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=config.lr)
        self.patch = fatorch.patch_sdpa(spec.policy, kernel=spec.kernel, **dict(spec.tiling))
        self.loss_sum, self.loss_n, self.seconds = 0.0, 0, 0.0

    def train_step(self, pixels, labels):
        start = time.perf_counter()
        with self.patch:
            loss = self.model.loss(pixels, labels)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        self.opt.step()
        loss = loss.detach()
        self.loss_sum += loss.item()
        self.loss_n += 1
        self.seconds += time.perf_counter() - start

    def eval_loss(self, pixels, labels):
        with torch.no_grad(), self.patch:
            return float(self.model.loss(pixels, labels))

    def reset(self):
        self.loss_sum, self.loss_n, self.seconds = 0.0, 0, 0.0

    def state(self):
        return {"model": self.model.state_dict(), "opt": self.opt.state_dict()}

    def restore(self, state):
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])


def save_atomic(obj, path):
    """torch.save ``obj`` to ``path`` atomically: a temporary file, fsynced, renamed over ``path``."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _save_checkpoint(path, key, step, runs):
    save_atomic({"config": key, "step": step, "runs": {name: r.state() for name, r in runs.items()}}, path)


def track(config, runs, pairs, out=None, checkpoint=True, device="cpu", callback=None, log=None):
    """Train ``runs`` (RunSpecs) in lockstep for ``config.steps`` updates and log the distances of
    ``pairs`` (Pairs) and each run's losses at steps 0, log_every, 2 log_every, ..., steps.

    ``out``: results file (.jsonl or .csv; resumable, module docstring) or None (in memory only);
    ``checkpoint``: True (``out + ".ckpt"``), a path, or False (resume recomputes from step 0);
    ``callback(step, models)``: called after each step this call logs, ``models`` = {run name: module};
    ``log(line)``: progress lines. Returns (drift, loss) DataFrames of every row of this configuration,
    sorted by step (rows logged by earlier, interrupted calls included).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config: expected a TrainConfig, got {type(config).__name__}")
    runs, pairs = _validate(runs, pairs)
    key = config_key(config, runs, pairs)
    ckpt = None
    if checkpoint is True and out is not None:
        ckpt = str(out) + ".ckpt"
    elif isinstance(checkpoint, (str, os.PathLike)):
        ckpt = str(checkpoint)
    elif checkpoint not in (True, False, None):
        raise TypeError(f"checkpoint must be True, False or a path, got {checkpoint!r}")
    file = ResultsFile(out) if out is not None else None
    try:
        return _track(config, runs, pairs, key, file, ckpt, device, callback, log or (lambda line: None))
    finally:
        if file is not None:
            file.close()


def rows_of(file, key):
    """The rows in ``file`` (None: none), all of configuration ``key``; ValueError if any is another's."""
    old = file.typed_rows() if file is not None else []
    other = sorted({r.get("config") for r in old} - {key}, key=str)
    if other:
        raise ValueError(f"results file {file.path!r} holds rows of another configuration (config {other[0]}; this "
                         f"one is {key}): write to another file or folder, or delete it to start over")
    return old


def _track(config, runs, pairs, key, file, ckpt, device, callback, log):
    old = rows_of(file, key)
    done = {r["key"] for r in old}
    rows = list(old)
    train_x, train_y, eval_x, eval_y = digits.load()
    eval_x, eval_y = eval_x[:config.eval_images].to(device), eval_y[:config.eval_images].to(device)

    def emit(row):
        if row["key"] in done:
            return
        if file is not None:
            file.append(row)
        done.add(row["key"])
        rows.append(row)

    with deterministic():
        state = {spec.name: _Run(spec, config, device) for spec in runs}
        start = 0
        if ckpt is not None and os.path.exists(ckpt):
            saved = torch.load(ckpt, weights_only=True)
            if saved.get("config") != key:
                raise ValueError(f"checkpoint {ckpt!r} belongs to another configuration (config "
                                 f"{saved.get('config')}; this one is {key}): delete it or write elsewhere")
            if saved["step"] <= config.steps:
                for name, run in state.items():
                    run.restore(saved["runs"][name])
                start = saved["step"]
                log(f"resuming from the checkpoint at step {start}")
            else:
                log(f"checkpoint at step {saved['step']} is past steps={config.steps}: recomputing from 0")

        def log_step(step):
            models = {name: r.model for name, r in state.items()}
            for p in pairs:
                k = f"{key}/{step}/pair/{p.name}"
                if k not in done:
                    emit(drift_row(key, step, p, models[p.a], models[p.b]))
            for name, r in state.items():
                k = f"{key}/{step}/run/{name}"
                if k not in done:
                    emit(loss_row(key, step, name, r.loss_sum / r.loss_n if r.loss_n else None,
                                  r.eval_loss(eval_x, eval_y), r.seconds))
                r.reset()
            if ckpt is not None and step > start:
                _save_checkpoint(ckpt, key, step, state)
            if callback is not None:
                callback(step, models)

        if start == 0:
            log_step(0)
        for step in range(start, config.steps):
            idx = torch.from_numpy(digits.batch_indices(step, config.batch, len(train_x), config.data_seed))
            x, y = train_x[idx].to(device), train_y[idx].to(device)
            for r in state.values():
                r.train_step(x, y)
            done_steps = step + 1
            if done_steps % config.log_every == 0 or done_steps == config.steps:
                log_step(done_steps)
                log(f"step {done_steps}/{config.steps}: " + ", ".join(
                    f"{p.name} {rows_for(rows, key, done_steps, p.name):.3g}" for p in pairs))
    return frames(rows, key, config.steps)


def drift_row(key, step, pair, a, b):
    """The drift row of ``pair`` at ``step``: distances of weights ``a`` from ``b`` (modules or state dicts)."""
    return drift_rows(key, step, pair, a, b)[0]


def drift_rows(key, step, pair, a, b, groups=None):
    """[the drift row of ``pair`` at ``step``, then one ``kind="layer"`` row per group of ``groups(name)``
    (fadev.weights.compare's groups; None: no layer rows)] -- one comparison of the two models."""
    df = weights.compare(a, b, groups=groups)
    d = df.attrs["model"]
    rows = [{"key": f"{key}/{step}/pair/{pair.name}", "config": key, "kind": "drift", "step": step, "pair": pair.name,
             "role": pair.role, "a": pair.a, "b": pair.b, "max_abs": d["max_abs"], "wasserstein": d["wasserstein"],
             "rmse": d["rmse"], "rel_l2": d["rel_l2"], "max_abs_tensor": df.attrs["max_abs_tensor"]}]
    for g in df.attrs.get("groups", ()):
        rows.append({"key": f"{key}/{step}/layer/{pair.name}/{g['name']}", "config": key, "kind": "layer",
                     "step": step, "pair": pair.name, "role": pair.role, "group": g["name"], "numel": g["numel"],
                     "max_abs": g["max_abs"], "wasserstein": g["wasserstein"], "rel_l2": g["rel_l2"]})
    return rows


def loss_row(key, step, name, train_loss, eval_loss, seconds):
    return {"key": f"{key}/{step}/run/{name}", "config": key, "kind": "loss", "step": step, "run": name,
            "train_loss": train_loss, "eval_loss": eval_loss, "seconds": seconds}


def frames(rows, key, steps):
    """(drift, loss) DataFrames of the rows of configuration ``key`` up to ``steps``, sorted by step."""
    mine = [r for r in rows if r.get("config") == key and r["step"] <= steps]
    drift = frame(sorted((r for r in mine if r["kind"] == "drift"), key=lambda r: r["step"]))
    loss = frame(sorted((r for r in mine if r["kind"] == "loss"), key=lambda r: r["step"]))
    return drift, loss


def layer_frame(rows, key, steps):
    """The ``kind="layer"`` rows (:func:`drift_rows`) of configuration ``key`` up to ``steps``, sorted by step."""
    return frame(sorted((r for r in rows if r.get("config") == key and r["kind"] == "layer" and r["step"] <= steps),
                        key=lambda r: r["step"]))


def rows_for(rows, key, step, pair):
    """max_abs of ``pair`` at ``step`` among ``rows`` (for the progress line)."""
    for r in reversed(rows):
        if r.get("config") == key and r["kind"] == "drift" and r["step"] == step and r["pair"] == pair:
            return r["max_abs"]
    return math.nan


__all__ = ["RunSpec", "Pair", "TrainConfig", "track", "config_key", "deterministic", "save_atomic", "ROLES", "UNKEYED"]
