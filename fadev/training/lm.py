"""The Llama training-drift workload: a byte-level causal language model (Hugging Face transformers'
``LlamaForCausalLM``, built from a ``LlamaConfig`` with random init: nothing is downloaded) trained on real
text (:mod:`fadev.training.text`), one *arm* at a time, resumably.

An arm (:class:`Arm`) is one training run: the attention kernel and policy of every attention layer, the
precision of the rest of the model, the init seed. It trains alone (:class:`ArmTask`, a task for
fadev.sweep's executors) and leaves in its folder

* ``state.pt``: model, optimizer, RNG states, step, the loss accumulators and the logged losses, written
  every ``checkpoint_every`` updates and when the task stops (temp file, fsync, rename);
* ``progress.json``: the step and logged losses of ``state.pt``, small, for the driver;
* ``w{step:07d}.pt``: the fp32 master weights at every logged step, until the driver has compared them.

A task started again continues from ``state.pt``; an arm's trajectory depends only on its spec, the config
and the step (init seed, data windows of (step, seed), deterministic kernels), so a resumed arm's bits
equal an uninterrupted one's (tests/test_lm.py).

Precision. ``"fp32"``: every operation in float32. ``"bf16"``: autocast-style mixed precision, emulated as in
:mod:`fadev.training.digits` on every device -- each ``nn.Linear`` (every matmul of the model: q, k, v, o,
gate, up, down, lm_head) rounds input, weight, bias, output and their gradients to bf16 with fp32
accumulation; master weights, embeddings, RMSNorm, rotary embedding, residual stream, loss and Adam in
fp32 -- which is what ``torch.autocast(dtype=torch.bfloat16)`` does to this model up to the order of the fp32
sums (the attention's own rounding of q, k, v is its policy's ``input`` stage). Measured on a CPU without
bf16 units: real CPU autocast is about 8x slower per step than this emulation.

``"bf16_autocast"``: real mixed precision, ``torch.autocast(dtype=torch.bfloat16)`` around the forward (as a
user trains): the model's matmuls, and the attention, run on bf16 tensors with the hardware's arithmetic; master
weights, the loss and Adam in fp32. The real-kernel arms use it (:data:`REAL_KERNELS`).

Attention. Emulated and native arms build the model with ``attn_implementation="fadev_mixed"``: fadev's Hugging
Face attention (:mod:`fadev.hf`), whose kernel :func:`attention` chooses per arm -- the one context manager every
forward and backward of the arm runs in: ``fadev.hf.use(policy, kernel=...)``, fadev's emulated kernels under
the arm's policy, or ``kernel="native"``, fadev's tensor-core kernel (CUDA). The native kernel reads bf16
tensors, so "fadev_mixed" hands it q, k, v cast to bf16 (nearest-even, what the emulated policies' ``input``
stage does and what autocast does before SDPA) and casts its output back to the model's float32. The real-kernel
arms use transformers' own implementations: ``kernel="eager"`` (materialised attention, ``attn_implementation=
"eager"``) and ``kernel="sdpa_flash"`` (``"sdpa"`` with PyTorch's flash backend forced by
``torch.nn.attention.sdpa_kernel``: an error, not a silent fallback, where flash cannot run).

Determinism. Every arm runs with ``torch.use_deterministic_algorithms(True)`` (PyTorch's flash backward then
takes its deterministic path), cuBLAS' deterministic workspace, TF32 off and one CPU thread; fadev's native
backward is deterministic by default. The control arms prove it: their distance must be exactly 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
import typing

import torch
import torch.nn as nn
import torch.nn.functional as F

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .. import hf as fahf
from ..torch import autocast_dtype
from ..backends import subset
from ..native import native_tiles
from . import digits, text
from .tracker import RunSpec, config_key, deterministic, save_atomic

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "bf16_autocast": None}
"""{precision: the dtype its emulated mixed-precision Linear layers round to (None: none)}."""
AUTOCAST = {"bf16_autocast": torch.bfloat16}
"""Precisions that run the forward under real ``torch.autocast`` to this dtype."""
ATTENTION = "fadev_mixed"
"""The attention implementation the model is built with for fadev's kernels (module docstring)."""
REAL_KERNELS = {"eager": "eager", "sdpa_flash": "sdpa"}
"""Kernels that are transformers' own attention: {kernel: attn_implementation}."""


@dataclasses.dataclass(frozen=True)
class Arm(RunSpec):
    """One arm of the Llama study (:class:`fadev.training.RunSpec`'s fields): ``kernel`` "baseline" or
    "flash" (fadev's emulated kernels under ``policy``), "native" (fadev's tensor-core FlashAttention-2
    kernel on CUDA), "eager" (transformers' materialised attention) or "sdpa_flash" (PyTorch's SDPA flash
    kernel) -- for the last three ``policy`` only names the preset modelling them; ``tiling`` block_q,
    block_kv for flash and native; ``precision`` "fp32", "bf16" (emulated mixed precision) or "bf16_autocast"
    (real autocast; module docstring)."""

    KERNELS: typing.ClassVar[tuple] = subset("baseline", "flash", "native", "eager", "sdpa_flash")
    PRECISIONS: typing.ClassVar[tuple] = tuple(PRECISIONS)
    TILED: typing.ClassVar[tuple] = ("flash", "native")


@dataclasses.dataclass(frozen=True)
class LMConfig:
    """Model and training settings shared by every arm: a Llama of ``layers`` blocks, width ``hidden``,
    ``heads`` query and ``heads_kv`` key/value heads, SwiGLU width ``ffn``; ``batch`` windows of ``seq``
    bytes per update, Adam with ``lr`` (no schedule, no weight decay) for ``steps`` updates; weights and
    losses logged every ``log_every`` updates (and at 0 and ``steps``) with the held-out loss over
    ``eval_windows`` windows, and at ``log_points`` steps spaced evenly on a log scale from update 1 (0: none):
    the first updates, where a perturbation starts to grow, are seen; state saved every ``checkpoint_every``
    updates; ``data``: "stdlib" or a path (:mod:`fadev.training.text`)."""

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    heads_kv: int = 4
    ffn: int = 344
    seq: int = 64
    batch: int = 8
    lr: float = 1e-3
    steps: int = 150
    log_every: int = 10
    checkpoint_every: int = 50
    eval_windows: int = 16
    data_seed: int = 0
    data: str = text.STDLIB
    log_points: int = 0

    def __post_init__(self):
        for f in ("hidden", "layers", "heads", "heads_kv", "ffn", "seq", "batch", "steps", "log_every",
                  "checkpoint_every", "eval_windows"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.heads_kv:
            raise ValueError(f"heads ({self.heads}) must be a multiple of heads_kv ({self.heads_kv})")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        for f in ("data_seed", "log_points"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{f} must be a non-negative int, got {v!r}")
        if not isinstance(self.data, str) or not self.data:
            raise ValueError(f"data must be 'stdlib' or a path, got {self.data!r}")

    def logged_steps(self) -> list:
        """Steps 0, every ``log_every``-th, ``log_points`` log-spaced ones (from 1) and ``steps``, sorted."""
        spaced = [round(self.steps ** (i / (self.log_points - 1))) for i in range(self.log_points)] \
            if self.log_points > 1 else [1] * self.log_points
        return sorted({0, self.steps, *range(self.log_every, self.steps, self.log_every), *spaced})


def parameters(config: LMConfig) -> int:
    """The model's parameter count (embeddings and lm_head untied)."""
    h, kv = config.hidden, config.hidden // config.heads * config.heads_kv
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * config.ffn + 2 * h
    return config.layers * per_layer + 2 * text.VOCAB * h + h


def study_key(config, arms, pairs, fingerprint) -> str:
    """The configuration hash of the rows and states: config (but steps, checkpoint_every), arms, pairs and
    the corpus fingerprint."""
    return config_key(config, arms, pairs, corpus=fingerprint, workload="llama")


# ---------------------------------------------------------------- model, precision, attention

def build(config: LMConfig, init_seed: int, precision: str, device="cpu", attn_implementation=ATTENTION):
    """``LlamaForCausalLM`` with random init (torch.manual_seed(init_seed), built on the CPU, then moved: the
    same weights whatever the attention), in ``precision`` (module docstring), attention through
    ``attn_implementation`` (default: fadev's, :func:`attention` chooses the kernel)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    cfg = LlamaConfig(vocab_size=text.VOCAB, hidden_size=config.hidden, intermediate_size=config.ffn,
                      num_hidden_layers=config.layers, num_attention_heads=config.heads,
                      num_key_value_heads=config.heads_kv, max_position_embeddings=config.seq,
                      bos_token_id=text.BOS, eos_token_id=text.EOS, pad_token_id=text.PAD, tie_word_embeddings=False,
                      attention_dropout=0.0, use_cache=False)
    torch.manual_seed(init_seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    low = PRECISIONS[precision]
    for m in model.modules():
        if type(m) is nn.Linear and low is not None:
            m.__class__ = digits.Linear  # the same module and parameters, its matmul in mixed precision
            m.low = low
    return model.to(device)


def layer_of(name: str) -> str:
    """The group of state-dict tensor ``name`` for per-layer distances: "embed", "layer I" (decoder block I:
    its attention, MLP and norms), "norm" (the final RMSNorm) or "lm_head"."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 2:
        return f"layer {parts[2]}"
    if parts[:2] == ["model", "embed_tokens"]:
        return "embed"
    if parts[:2] == ["model", "norm"]:
        return "norm"
    return parts[0]


def native_unavailable(device, head_dim, block_q, block_kv) -> str | None:
    """Why a native arm with this tile cannot run on ``device`` (None: it can)."""
    if device != "cuda":
        return "the native kernel runs on CUDA only (--device cuda)"
    tiles = native_tiles(head_dim)
    if (block_q, block_kv) not in tiles:
        return f"{block_q}x{block_kv} is not a native tile for head dim {head_dim} (its tiles: {tiles or 'none'})"
    return None


def attention(arm: Arm):
    """The context manager every forward and backward of ``arm``'s model runs in: its attention kernel."""
    if arm.kernel == "native":
        return fahf.use(kernel="native", **dict(arm.tiling))
    if arm.kernel == "sdpa_flash":  # forced: an error where flash cannot run, never another backend's numbers
        return _Reentrant(lambda: torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION))
    if arm.kernel == "eager":
        return contextlib.nullcontext()
    return fahf.use(arm.policy, kernel=arm.kernel, **dict(arm.tiling))


def autocast(arm: Arm, device):
    """The context ``arm``'s forward runs in: ``torch.autocast`` for "bf16_autocast", else nothing."""
    dtype = AUTOCAST.get(arm.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


class _Reentrant:
    """A context manager entered again and again (each entry a fresh one from ``make``)."""

    def __init__(self, make):
        self.make, self.stack = make, []

    def __enter__(self):
        ctx = self.make()
        self.stack.append(ctx)
        return ctx.__enter__()

    def __exit__(self, *exc):
        return self.stack.pop().__exit__(*exc)


def _attention_forward(module, query, key, value, *args, **kwargs):
    """fadev.hf's attention; outside torch.autocast, float32 q, k, v cast to bf16 for the native kernel and its output
    cast back (under autocast fadev.hf casts them as PyTorch's SDPA would, and the output stays in autocast's dtype,
    as SDPA's does: no cast back and forth around every layer)."""
    if (fahf.current().kernel != "native" or query.dtype in (torch.float16, torch.bfloat16)
            or autocast_dtype(query) is not None):
        return fahf.attention_forward(module, query, key, value, *args, **kwargs)
    out, weights = fahf.attention_forward(module, *(t.to(torch.bfloat16) for t in (query, key, value)), *args,
                                          **kwargs)
    return out.to(query.dtype), weights


AttentionInterface.register(ATTENTION, _attention_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def loss_of(model, inputs, targets):
    """Mean cross-entropy per byte (nats), in float32."""
    logits = model(input_ids=inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------- one arm, resumable

def _rng_state(device):
    state = {"torch": torch.get_rng_state()}
    if device == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    if device == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def arm_folder(root, name):
    return os.path.join(root, name)


def snapshot_path(root, name, step):
    return os.path.join(root, name, f"w{step:07d}.pt")


def read_progress(root, name, key):
    """{"step", "log"} of arm ``name``'s last state (step 0, no log: not started). ValueError when its folder
    holds another configuration's state."""
    path = os.path.join(root, name, "progress.json")
    if not os.path.exists(path):
        return {"step": 0, "log": {}, "train_s": 0.0}
    with open(path) as fh:
        saved = json.load(fh)
    if saved.get("key") != key:
        raise ValueError(f"{os.path.dirname(path)!r} holds the state of another configuration (config "
                         f"{saved.get('key')}; this one is {key}): write to another --out folder, or delete it")
    return {"step": saved["step"], "log": {int(s): v for s, v in saved["log"].items()}, "train_s": saved["train_s"]}


class _Training:
    """An arm's model, optimizer and loss accumulators on ``device``."""

    def __init__(self, arm, config, device, corpus):
        self.arm, self.config, self.device, self.corpus = arm, config, device, corpus
        self.model = build(config, arm.init_seed, arm.precision, device,
                           REAL_KERNELS.get(arm.kernel, ATTENTION))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=config.lr)
        self.attn = attention(arm)
        self.amp = _Reentrant(lambda: autocast(arm, device))
        self.step, self.log = 0, {}
        self.loss_sum, self.loss_n, self.seconds = 0.0, 0, 0.0
        self.train_s = 0.0  # seconds of training updates since step 0, over every task (a timing: not in the rows)
        x, y = text.eval_windows(corpus.held_out, config.eval_windows, config.seq)
        self.eval_x, self.eval_y = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)

    def train_step(self):
        start = time.perf_counter()
        x, y = text.batch(self.corpus.train, self.step, self.config.batch, self.config.seq, self.config.data_seed)
        x, y = torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)
        with self.attn:
            with self.amp:
                loss = loss_of(self.model, x, y)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        self.opt.step()
        self.loss_sum += loss.detach().item()
        self.loss_n += 1
        self.step += 1
        self.seconds += time.perf_counter() - start
        self.train_s += time.perf_counter() - start

    def eval_loss(self):
        with torch.no_grad(), self.attn, self.amp:
            return float(loss_of(self.model, self.eval_x, self.eval_y))

    def log_step(self, root, key):
        """Weights to w{step}.pt, the losses to the log; the accumulators restart."""
        weights = {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        save_atomic({"key": key, "step": self.step, "weights": weights}, snapshot_path(root, self.arm.name, self.step))
        train = self.loss_sum / self.loss_n if self.loss_n else None
        self.log[self.step] = [train, self.eval_loss(), self.seconds]
        self.loss_sum, self.loss_n, self.seconds = 0.0, 0, 0.0

    def save(self, root, key):
        folder = arm_folder(root, self.arm.name)
        save_atomic({"key": key, "step": self.step, "model": self.model.state_dict(), "opt": self.opt.state_dict(),
                     "rng": _rng_state(self.device), "acc": [self.loss_sum, self.loss_n, self.seconds, self.train_s],
                     "log": self.log}, os.path.join(folder, "state.pt"))
        tmp = os.path.join(folder, "progress.json.tmp")
        with open(tmp, "w") as fh:
            json.dump({"key": key, "step": self.step, "log": self.log, "train_s": self.train_s}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(folder, "progress.json"))

    def restore(self, root, key):
        path = os.path.join(arm_folder(root, self.arm.name), "state.pt")
        saved = torch.load(path, map_location=self.device, weights_only=True)
        if saved.get("key") != key:
            raise ValueError(f"{path!r} belongs to another configuration (config {saved.get('key')}; this one is "
                             f"{key}): write to another --out folder, or delete it")
        self.model.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["opt"])
        _set_rng_state({k: v.cpu() for k, v in saved["rng"].items()}, self.device)
        self.loss_sum, self.loss_n, self.seconds, self.train_s = saved["acc"]
        self.step, self.log = saved["step"], {int(s): v for s, v in saved["log"].items()}


class ArmTask:
    """point {"run": name, "until": step, "device": device[, "gpu": index]} -> {"key": name, "step": reached, "log": {step:
    [train_loss, eval_loss, seconds]}, "train_s": seconds of all its updates so far}: arm ``name`` trained from
    its saved state (or from its init) up to update ``until``, stopping early before ``deadline``
    (time.time(); None: none) -- it stops before an update when twice the slowest update so far plus the last
    save would pass it -- and saved where it stops. A plain class (it pickles for executors in other
    processes)."""

    def __init__(self, config, arms, key, root, deadline=None):
        self.config, self.arms, self.key, self.root, self.deadline = config, arms, key, root, deadline

    def __call__(self, point):
        device, until, arm = point["device"], point["until"], self.arms[point["run"]]
        if device == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, in every process
            torch.backends.cuda.matmul.allow_tf32 = False  # "fp32" means fp32 (PyTorch's default, made sure)
            torch.backends.cudnn.allow_tf32 = False
            if point.get("gpu") is not None:  # the driver spreads the arms over the GPUs it sees
                torch.cuda.set_device(point["gpu"])
        corpus = text.load(self.config.data)
        os.makedirs(arm_folder(self.root, arm.name), exist_ok=True)
        logged = set(self.config.logged_steps())
        with deterministic():
            run = _Training(arm, self.config, device, corpus)
            if os.path.exists(os.path.join(arm_folder(self.root, arm.name), "state.pt")):
                run.restore(self.root, self.key)
            elif 0 in logged:
                run.log_step(self.root, self.key)
            slowest, save_s, start_step = 0.0, 0.0, run.step
            while run.step < until:
                if self.deadline is not None and time.time() + 2 * slowest + save_s > self.deadline:
                    break
                t = time.perf_counter()
                run.train_step()
                if run.step in logged:
                    run.log_step(self.root, self.key)
                if run.step % self.config.checkpoint_every == 0 and run.step < until:
                    s = time.perf_counter()
                    run.save(self.root, self.key)
                    save_s = time.perf_counter() - s
                slowest = max(slowest, time.perf_counter() - t)
            if run.step > start_step or not os.path.exists(os.path.join(arm_folder(self.root, arm.name), "state.pt")):
                run.save(self.root, self.key)
        return {"key": arm.name, "step": run.step, "log": run.log, "train_s": run.train_s}


def load_snapshot(root, name, step, key, device="cpu"):
    """Arm ``name``'s weights at ``step`` (on ``device``: "cuda" compares them on the GPU)."""
    saved = torch.load(snapshot_path(root, name, step), map_location=device, weights_only=True)
    if saved.get("key") != key:
        raise ValueError(f"{snapshot_path(root, name, step)!r} belongs to another configuration")
    return saved["weights"]


__all__ = ["Arm", "LMConfig", "ArmTask", "build", "attention", "autocast", "layer_of", "native_unavailable", "loss_of",
           "parameters", "study_key", "read_progress", "load_snapshot", "snapshot_path", "PRECISIONS", "AUTOCAST",
           "ATTENTION", "REAL_KERNELS"]
