"""Training drift (Golden et al., arXiv 2405.02803, Section 5): the workload and the tracker behind the
``train_drift`` experiment (:mod:`fadev.experiments.train_drift`, ``python -m fadev train-drift``), which
measures how far the weights of a model trained with flash attention drift from the same training with
baseline attention, next to two references -- another initialisation seed and low-precision (mixed
bf16/fp16) training.

* :mod:`fadev.training.digits`: the workload, a label-conditioned autoregressive transformer over
  scikit-learn's 8 x 8 digits (shipped with the package, no download);
* :mod:`fadev.training.tracker`: runs in lockstep, distances between pairs of runs every k steps into a
  resumable results file (:func:`track`);
* :mod:`fadev.training.arms`: the same rows with each run trained as an independent task on an executor
  (Ray, local processes; :func:`track_tasks`);
* :mod:`fadev.training.text`, :mod:`fadev.training.lm`, :mod:`fadev.training.lm_track`: the study at scale,
  a Hugging Face Llama trained on bytes of the standard library's source, arms as resumable tasks.

Needs PyTorch and scikit-learn (the Llama workload: transformers); ``import fadev`` imports neither, and neither does importing this package:
its names and submodules load on first use.
"""
import importlib

__all__ = ["Pair", "RunSpec", "TrainConfig", "track", "track_tasks", "config_key", "deterministic"]


def __getattr__(name):  # torch is imported on first use, so that `python -m fadev --help` works without it
    if name in ("digits", "tracker", "arms", "text", "lm", "lm_track"):
        return importlib.import_module(f"{__name__}.{name}")
    if name == "track_tasks":
        return importlib.import_module(f"{__name__}.arms").track_tasks
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.tracker"), name)
    raise AttributeError(f"module 'fadev.training' has no attribute {name!r}")
