"""A monitor people leave on: sampled fp64 checks of a model's attention while it trains.

While a :class:`Monitor` is active, every ``torch.nn.functional.scaled_dot_product_attention`` call runs
exactly as before (PyTorch's own kernel, or whatever the function was when the monitor was entered, e.g.
:class:`fadev.torch.patch_sdpa`'s fadev policy), and every ``sample_every``-th call of each attention
layer is also computed by the reference -- softmax(scale q k^T + mask) v in float64, on the inputs'
device, at ``rows`` query rows, every key -- and the deviation of the model's actual output on those rows
from it is logged::

    rows  r = o, o + s, o + 2s, ... < L,   s = ceil(L / rows),  o = (sample number of the layer) mod s
    d     = out[..., r, :] - ref[..., r, :]                          over batch, heads, rows and channels
    max_abs = max |d|,  mean_abs = mean |d|,  rel_rms = sqrt(sum d^2 / sum ref^2),  nonfinite = #(out not finite)

At most ``rows`` rows are checked per call; the offset moves by one at each sample, so s consecutive samples
check every position once (causal attention's early rows see few keys, the late ones many). The reference
reads the call's arguments as SDPA does: ``scale`` (default 1/sqrt(E)), ``is_causal`` (query i sees keys
j <= i, SDPA's top-left alignment), ``attn_mask`` (bool: True attends; float: added to the scores; broadcast
as SDPA broadcasts it), grouped query heads (query head h reads key/value head h // (H / H_kv)); a row that
sees no key is 0, as SDPA gives.
Its float64 sums are exact to a few float64 ulps, so ``rel_rms`` of a float64 model is ~1e-16 and that of
a bf16 model is bf16's error, not the reference's.

The monitor never changes what the model computes: it reads detached views of the call's inputs and output
under ``torch.no_grad`` after the call returned, draws no random numbers and keeps no tensor of the model
(outputs and gradients are bit-identical with and without it). On CUDA the statistics stay on the device
and are copied to pinned host memory without waiting; a record is completed when its CUDA event has passed
(or at :meth:`Monitor.flush`), so sampling adds no synchronisation to the training loop.

Layers are named by the innermost ``nn.Module`` whose method is running when SDPA is called (found on the
Python call stack, so no module hooks slow the model down): its qualified name in ``model`` when given,
else in the outermost module on the stack (``model.layers.0.self_attn``); a call from outside any module
is named by its call site. Not seen: code that bound SDPA at import time, and ``nn.MultiheadAttention``'s
inference fast path (eval mode without gradients), which the monitor leaves on so as not to change the model.
"""
from __future__ import annotations

import csv as _csv
import math
import os
import sys
import warnings
import weakref

import pandas as pd
import torch
import torch.nn.functional as F

from . import _args
from .formats import boolean, integer

_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)  # torch >= 2.3

METRICS = ("max_abs", "mean_abs", "rel_rms", "nonfinite")
COLUMNS = ("step", "layer", "module_type", "call", "attention", "dtype", "q_shape", "k_shape", "is_causal",
           "mask", "rows", "row_offset", "row_stride", "n") + METRICS
"""The fields of every record, in the CSV's column order."""


def _sampled_rows(length, rows, sample):
    """The query rows of one sample: (slice, count, spacing). Every s-th row from offset o, s = ceil(length /
    rows), o = sample mod s: at most ``rows`` rows, and every row once in s consecutive samples."""
    stride = -(-length // rows)
    offset = sample % stride
    return slice(offset, length, stride), len(range(offset, length, stride)), stride


def _per_head(a, b):
    """``a @ b`` per attention head: a's heads, when they are a multiple of b's, read b's head h // (H / H_b)
    (grouped-query attention; one key/value head is the case of a broadcast); otherwise plain broadcasting."""
    heads, kv_heads = a.shape[-3], b.shape[-3]
    if heads == kv_heads or heads % kv_heads:
        return a @ b
    out = a.reshape(*a.shape[:-3], kv_heads, heads // kv_heads, *a.shape[-2:]) @ b.unsqueeze(-3)
    return out.reshape(*out.shape[:-4], heads, *out.shape[-2:])


CHUNK_BYTES = 1 << 28
"""Largest float64 copy of keys and values (bytes) the reference makes at once; more key/value heads are done
in turns, so a long-context model's check does not hold a float64 copy of its whole K and V."""


def _reference(q, k, v, positions, mask, scale):
    """float64 attention of query rows ``q`` (at sequence ``positions``; ``mask`` already cut to them)."""
    f64 = torch.float64
    k = k.to(f64)
    scores = _per_head(q.to(f64), k.transpose(-1, -2)) * scale
    if positions is not None:  # causal: query at position i sees keys j <= i
        seen = torch.arange(k.shape[-2], device=scores.device) <= positions[:, None]
        scores = scores.masked_fill(~seen, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.to(f64)
    top = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(top == -math.inf, 0.0, top))  # a row seeing no key: all 0
    total = weights.sum(-1, keepdim=True)
    out = _per_head(weights, v.to(f64))
    return torch.where(total > 0, out / torch.where(total > 0, total, 1.0), 0.0)


def reference_attention(query, key, value, *, attn_mask=None, is_causal=False, scale=None, align="top_left"):
    """fadev's one fp64 reference attention for torch tensors: softmax(scale q k^T + mask) v in float64 on the
    inputs' device, differentiable, as ``scaled_dot_product_attention(query, key, value, attn_mask, 0.0,
    is_causal, scale, enable_gqa=True)`` defines it. ``attn_mask``: boolean (True: the key is seen) or
    additive. ``is_causal`` with ``align="top_left"`` (SDPA's: query i sees keys j <= i) or "bottom_right"
    (fadev's kernels and FlashAttention's: j <= i + N_kv - N_q). Grouped-query heads read K/V head
    h // (H / H_kv); a row that sees no key gives 0. :func:`reference_rows` computes some rows of it in
    bounded memory (the monitor's check); experiments, benchmarks and tests call this one."""
    _args.choice("align", align, ("top_left", "bottom_right"))
    if query.dim() == 2:
        return reference_attention(query[None], key[None], value[None], attn_mask=attn_mask, is_causal=is_causal,
                                   scale=scale, align=align)[0]
    nq, nk = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    positions = None
    if boolean(is_causal, "is_causal"):
        positions = torch.arange(nq, device=query.device) + (nk - nq if align == "bottom_right" else 0)
    return _reference(query, key, value, positions, attn_mask, scale)


def reference_rows(query, key, value, rows, attn_mask=None, is_causal=False, scale=None):
    """The float64 attention output at query rows ``rows`` (a slice of the sequence dim), on the inputs'
    device, as ``scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale,
    enable_gqa)`` defines it; shape ``out[..., rows, :]``. Key/value heads are taken a few at a time
    (:data:`CHUNK_BYTES`)."""
    with torch.no_grad():
        q, k, v = (t.detach() for t in (query, key, value))
        if q.dim() == 2:
            return reference_rows(q[None], k[None], v[None], rows, attn_mask, is_causal, scale)[0]
        length = q.shape[-2]
        q = q[..., rows, :]
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        positions = torch.arange(length, device=q.device)[rows] if is_causal else None
        mask = attn_mask.detach() if attn_mask is not None else None
        if mask is not None and mask.dim() >= 2 and mask.shape[-2] == length:
            mask = mask[..., rows, :]
        heads, kv_heads = q.shape[-3], k.shape[-3]
        per_head = 8 * (k[..., :1, :, :].numel() + v[..., :1, :, :].numel())
        step = kv_heads if heads % kv_heads else max(1, CHUNK_BYTES // max(per_head, 1))
        group = heads // kv_heads if heads >= kv_heads else 1
        parts = []
        for h in range(0, kv_heads, step):
            kv, hq = slice(h, h + step), slice(h * group, (h + step) * group)
            part_mask = mask[..., hq, :, :] if mask is not None and mask.dim() >= 3 and mask.shape[-3] > 1 else mask
            parts.append(_reference(q[..., hq, :, :], k[..., kv, :, :], v[..., kv, :, :], positions, part_mask,
                                    scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-3)


def deviation(out, ref):
    """[max_abs, mean_abs, rel_rms, nonfinite] of ``out`` against ``ref`` as one float64 tensor on their
    device (no host synchronisation)."""
    out = out.detach().to(torch.float64)
    diff = out - ref
    size = diff.abs()
    rel = (diff.square().sum() / ref.square().sum()).sqrt()
    return torch.stack([size.amax(), size.mean(), rel, (~torch.isfinite(out)).sum().to(torch.float64)])


def _check_path(value, name):
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike) or None, got {type(value).__name__}")
    return value


def _caller_modules(frame):
    """The ``nn.Module`` objects whose methods run at ``frame`` and above (their ``self``), innermost first."""
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            obj = frame.f_locals.get("self")
            if isinstance(obj, torch.nn.Module):
                yield obj
        frame = frame.f_back


class LayerNames:
    """Names the layer that calls attention: ``names(frame)`` is (qualified name, class name) of the innermost
    ``nn.Module`` whose method runs at ``frame`` or above (found on the Python call stack, so no module hooks
    slow the model down), or (None, None) outside any module. The name is the module's attribute path in
    ``model`` (read when the names are made) when it belongs to it, else in the outermost module on the stack
    (``layers.0.self_attn``); the class name when that is the module itself. Names are cached per module
    (weakly: no module is kept alive)."""

    def __init__(self, model=None):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        self._names = weakref.WeakKeyDictionary()
        for name, module in model.named_modules() if model is not None else ():
            self._names.setdefault(module, name or type(module).__name__)

    def __call__(self, frame):
        modules = _caller_modules(frame)
        module = next(modules, None)
        if module is None:
            return None, None
        name = self._names.get(module)
        if name is None:
            outer = ([module] + list(modules))[-1]
            name = next((n for n, m in outer.named_modules() if m is module), "") or type(module).__name__
            self._names[module] = name
        return name, type(module).__name__


class Monitor:
    """``with Monitor(sample_every=100, rows=16, log_dir=None, csv=None, model=None) as mon:`` (built by
    ``fadev.torch.shadow(sample_every=..., ...)``; the module docstring says what is computed).

    ``sample_every``: every k-th call of each layer is checked (calls 0, k, 2k, ...); ``rows``: query rows
    per check (all of them when the sequence is shorter); ``log_dir``: a TensorBoard run directory
    (``torch.utils.tensorboard.SummaryWriter``; scalars ``attention/<layer>/<metric>`` at the step);
    ``csv``: a file the records are appended to as they complete (written with a header when new);
    ``model``: the module whose attribute names name the layers; ``inner``: a context manager entered before
    the monitor and left after it (fadev.torch.shadow passes a :class:`fadev.torch.patch_sdpa` for a candidate
    policy); ``attention``: what the model runs, for the records.

    ``mon.records`` (completed records, dicts with :data:`COLUMNS`), ``mon.to_dataframe()``,
    ``mon.summary()`` (one row per layer), ``mon.calls`` (SDPA calls seen), ``mon.skipped`` ({reason: count}
    of sampled calls the reference cannot compute: dropout, empty or nested tensors, a RuntimeError such as
    running out of memory, which is also warned about once; calls traced by torch.compile pass through
    unchecked). ``mon.step``: set it to your training step to log at that step;
    left None, a record's step is the index of the first layer's current call (the forward pass, when each
    calls every layer once).
    """

    def __init__(self, sample_every=100, rows=16, log_dir=None, csv=None, model=None, inner=None, attention="sdpa"):
        self.sample_every = integer(sample_every, "sample_every")
        self.rows = integer(rows, "rows")
        for name, value in (("sample_every", self.sample_every), ("rows", self.rows)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.log_dir, self.csv = _check_path(log_dir, "log_dir"), _check_path(csv, "csv")
        self._layer_names = LayerNames(model)
        self.attention = str(attention)
        self.step = None
        self.calls = 0
        self.skipped = {}
        self._records, self._pending = [], []
        self._counts, self._first_layer = {}, None
        self._inner, self._original, self._writer, self._file = inner, None, None, None

    # ------------------------------------------------------------ context

    def __enter__(self):
        if self._original is not None:
            raise RuntimeError("this monitor is already active (it cannot be entered twice)")
        writer = None
        if self.log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            writer = SummaryWriter(os.fspath(self.log_dir))
        if self._inner is not None:
            try:
                self._inner.__enter__()
            except BaseException:
                if writer is not None:
                    writer.close()
                raise
        self._writer = writer
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self._sdpa
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._original
        self._original = None
        try:
            self.flush()
        finally:
            if self._writer is not None:
                self._writer.close()
            if self._file is not None:
                self._file.close()
            self._writer = self._file = None
            if self._inner is not None:
                self._inner.__exit__(*exc)
        return False

    # ------------------------------------------------------------ the routed call

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        out = self._original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, **kwargs)
        self.calls += 1
        if _compiling():
            return out
        caller = sys._getframe(1)
        layer, module_type = self._layer_names(caller)
        if layer is None:
            layer = f"{caller.f_code.co_name} ({os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno})"
        call = self._counts.get(layer, 0)
        self._counts[layer] = call + 1
        if self._first_layer is None:
            self._first_layer = layer
        if call % self.sample_every == 0:
            self._sample(layer, module_type, call, out, query, key, value, attn_mask, dropout_p, is_causal, scale)
        return out

    def _skip(self, reason):
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def _sample(self, layer, module_type, call, out, q, k, v, mask, dropout_p, is_causal, scale):
        if dropout_p:
            return self._skip("dropout")
        if any(t.is_nested for t in (q, k, v, out)):
            return self._skip("nested tensors")
        if min(q.numel(), k.numel(), v.numel()) == 0:
            return self._skip("empty tensors")
        self._drain(block=False)
        rows, n, stride = _sampled_rows(q.shape[-2], self.rows, call // self.sample_every)
        try:
            ref = reference_rows(q, k, v, rows, mask, bool(is_causal), scale)
            with torch.no_grad():
                stats = deviation(out[..., rows, :], ref)
        except RuntimeError as e:  # out of memory, above all: the training run goes on, the check is skipped
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if reason not in self.skipped:
                warnings.warn(f"fadev monitor: a check of {layer} failed and is skipped ({reason})", RuntimeWarning,
                              stacklevel=3)
            return self._skip(reason)
        step = self.step if self.step is not None else self._counts[self._first_layer] - 1
        record = {"step": step, "layer": layer, "module_type": module_type, "call": call,
                  "attention": self.attention, "dtype": str(q.dtype).replace("torch.", ""),
                  "q_shape": tuple(q.shape), "k_shape": tuple(k.shape), "is_causal": bool(is_causal),
                  "mask": "none" if mask is None else "bool" if mask.dtype == torch.bool else "float",
                  "rows": n, "row_offset": rows.start, "row_stride": stride, "n": ref.numel()}
        if stats.device.type == "cuda":
            host = stats.to("cpu", non_blocking=True)  # pinned memory: no wait
            done = torch.cuda.Event()
            done.record()
            self._pending.append((record, host, done))
        else:
            self._complete(record, stats)

    # ------------------------------------------------------------ records

    def _complete(self, record, stats):
        record.update(zip(METRICS, stats.tolist()))
        record["nonfinite"] = int(record["nonfinite"])
        self._records.append(record)
        if self._writer is not None:
            for metric in METRICS:
                self._writer.add_scalar(f"attention/{record['layer']}/{metric}", record[metric], record["step"])
        if self.csv is not None:
            if self._file is None:
                new = not os.path.exists(self.csv) or os.path.getsize(self.csv) == 0
                self._file = open(self.csv, "a", newline="")  # noqa: SIM115 (closed on exit)
                self._csv_writer = _csv.DictWriter(self._file, COLUMNS)
                if new:
                    self._csv_writer.writeheader()
            self._csv_writer.writerow({c: "x".join(map(str, v)) if isinstance(v, tuple) else v
                                       for c, v in record.items()})
            self._file.flush()

    def _drain(self, block):
        while self._pending and (block or self._pending[0][2].query()):
            record, host, done = self._pending.pop(0)
            done.synchronize()
            self._complete(record, host)

    def flush(self):
        """Complete every pending record (waits for the GPU's statistics) and flush the TensorBoard and CSV
        writers."""
        self._drain(block=True)
        if self._writer is not None:
            self._writer.flush()

    @property
    def records(self):
        """The completed records (pending GPU statistics are completed first), oldest first."""
        self._drain(block=True)
        return self._records

    def to_dataframe(self):
        """:attr:`records` as a pandas DataFrame (one row per checked call, columns :data:`COLUMNS`)."""
        return pd.DataFrame.from_records(self.records, columns=list(COLUMNS))

    def summary(self):
        """One row per layer (in the order first seen): checks, the last step checked, the largest max_abs,
        the mean and the largest rel_rms, and the non-finite outputs seen. A DataFrame that prints whole in a
        terminal (every row and column, three significant digits; pandas' display limits would cut it to
        "..."); computing on it gives plain DataFrames."""
        df = self.to_dataframe()
        table = df.groupby("layer", sort=False).agg(checks=("call", "size"), last_step=("step", "max"),
                                                    max_abs=("max_abs", "max"), mean_rel_rms=("rel_rms", "mean"),
                                                    max_rel_rms=("rel_rms", "max"), nonfinite=("nonfinite", "sum"))
        return Summary(table)



class Summary(pd.DataFrame):
    """A monitor's per-layer summary (:meth:`Monitor.summary`): a DataFrame whose repr and str show every row
    and column (floats to 3 significant digits) whatever pandas' display limits; computing on it gives plain
    DataFrames."""

    @property
    def _constructor(self):
        return pd.DataFrame

    def __repr__(self):
        return self.to_string(float_format=lambda v: f"{v:.3g}", max_rows=None, max_cols=None, line_width=None)

    __str__ = __repr__
