"""The training-drift workload: a small label-conditioned autoregressive image transformer on the
handwritten digits shipped inside scikit-learn (``sklearn.datasets.load_digits``: 1797 images of 8 x 8
pixels with integer intensities 0..16 -- exactly 17 levels; read from the installed package, no download).

The model, a GPT-style decoder (Golden et al.'s drift study trains a text-to-image model; this is its
smallest honest relative): tokens = [label, p0, ..., p62] -> predicts p0 .. p63 (17-way softmax per
pixel, raster order), learned positional embeddings, ``layers`` pre-LayerNorm blocks of causal
multi-head self-attention (``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``,
looked up at call time so that :func:`fadev.torch.patch_sdpa` routes it through fadev's kernels) and a
GELU MLP (4 x width). No dropout: nothing random after the initialisation.

Precision (``precision=`` of :meth:`DigitsTransformer.forward`):

* ``"fp32"``: every operation in float32.
* ``"bf16"`` / ``"fp16"``: mixed precision as ``torch.autocast(dtype=...)`` applies it to this model,
  emulated in float32 tensors: every ``nn.Linear`` (all of the model's matmuls outside attention) rounds
  its input, weight and bias to the low format (round-to-nearest-even), multiplies with float32
  accumulation (products of two bf16/fp16 numbers are exact in float32) and rounds its output to the low
  format; in the backward the gradient reaching each of these roundings is rounded to the low format too
  (autocast's bf16 activations carry bf16 gradients; the weight gradient arrives in the fp32 master
  weight through the bf16 cast). Master weights, embeddings, LayerNorm, the residual stream, the
  cross-entropy and the optimizer stay float32 (autocast's fp32 ops / type promotion). Why emulate:
  torch's real bf16 matmuls are ~4x slower than float32 on a CPU without bf16 units (measured 300 vs 67
  ms per step) and the emulation gives the same roundings up to the order of the fp32 accumulation.

Attention numerics are not set here: the caller wraps the forward/backward in ``patch_sdpa(policy)``.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

LEVELS = 17
"""Pixel intensities 0..16."""
PIXELS = 64
CLASSES = 10
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
N_EVAL = 297
"""Held-out images: the last 297 of the 1797 (the first 1500 are the training set)."""


@functools.lru_cache(maxsize=1)
def load() -> tuple:
    """(train_pixels (1500, 64) int64, train_labels (1500,), eval_pixels (297, 64), eval_labels (297,)):
    load_digits in its shipped order, split at image 1500."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("the training-drift workload needs scikit-learn (pip install scikit-learn): its digits "
                          "images ship inside the package") from None
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(np.rint(x).astype(np.int64))
    y = torch.tensor(y.astype(np.int64))
    n = len(x) - N_EVAL
    return x[:n], y[:n], x[n:], y[n:]


def batch_indices(step: int, batch: int, n: int, data_seed: int) -> np.ndarray:
    """Training-set indices of update ``step`` (0-based): positions step*batch .. +batch-1 of the stream
    of epochs, epoch e being the permutation np.random.default_rng([data_seed, e]).permutation(n). A
    function of its arguments only, so a resumed run sees the same data as an uninterrupted one."""
    pos = np.arange(step * batch, (step + 1) * batch)
    out = np.empty(batch, dtype=np.int64)
    for epoch in np.unique(pos // n):
        perm = np.random.default_rng([data_seed, int(epoch)]).permutation(n)
        sel = pos // n == epoch
        out[sel] = perm[pos[sel] % n]
    return out


class _Round(torch.autograd.Function):
    """x rounded to ``dtype`` (nearest-even) and back to float32; the gradient rounded the same way."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.to(dtype).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).to(g.dtype), None


def _round(x, dtype):
    return x if dtype is None else _Round.apply(x, dtype)


class Linear(nn.Linear):
    """nn.Linear whose matmul runs in mixed precision when ``self.low`` is a dtype (module docstring)."""

    low = None

    def forward(self, x):
        if self.low is None:
            return super().forward(x)
        b = None if self.bias is None else _round(self.bias, self.low)
        return _round(F.linear(_round(x, self.low), _round(self.weight, self.low), b), self.low)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = Linear(width, 3 * width)
        self.proj = Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = Linear(width, 4 * width)
        self.fc2 = Linear(4 * width, width)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # looked up now: patch_sdpa routes it
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class DigitsTransformer(nn.Module):
    """Label-conditioned autoregressive transformer over the 64 pixels (module docstring). ``width``
    must be a multiple of ``heads``; head dim = width / heads."""

    def __init__(self, width=64, heads=4, layers=2):
        super().__init__()
        if width % heads:
            raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
        self.pixel = nn.Embedding(LEVELS, width)
        self.label = nn.Embedding(CLASSES, width)
        self.pos = nn.Parameter(torch.randn(PIXELS, width) * 0.02)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = Linear(width, LEVELS)

    def set_precision(self, precision):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        for m in self.modules():
            if isinstance(m, Linear):
                m.low = PRECISIONS[precision]

    def forward(self, pixels, labels):
        """Logits (B, 64, 17) for pixels (B, 64) int64 and labels (B,)."""
        x = torch.cat([self.label(labels)[:, None], self.pixel(pixels[:, :-1])], 1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def loss(self, pixels, labels):
        """Mean cross-entropy per pixel (nats), in float32."""
        logits = self.forward(pixels, labels)
        return F.cross_entropy(logits.float().reshape(-1, LEVELS), pixels.reshape(-1))


__all__ = ["DigitsTransformer", "Linear", "load", "batch_indices", "LEVELS", "PIXELS", "CLASSES", "PRECISIONS",
           "N_EVAL"]
