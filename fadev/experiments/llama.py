"""A small Llama-style decoder in fp64 PyTorch for the distributed ring study (fadev/experiments/ring_dist.py).

tokens -> embedding -> L x [h += Wo attn(rope(Wq RMSNorm h), rope(Wk RMSNorm h), Wv RMSNorm h);
                           h += W2 (silu(W1 RMSNorm h) * W3 RMSNorm h)] -> RMSNorm -> head -> cross-entropy
Grouped-query attention (heads_kv K/V heads), rotary embeddings on global positions, random init with a fixed
seed. The attention is a callable ``attn(q, k, v) -> out`` on (B, H, n, hd) / (B, Hkv, n, hd): exact fp64
softmax attention for the reference, fadev's ring (distributed or simulated) for the runs; everything
else is fp64, so every deviation from the reference comes from the attention.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..monitor import reference_attention
from ..ring import as_merge, ring_attention, ring_attention_backward

KINDS = {"wq": "attn", "wk": "attn", "wv": "attn", "wo": "attn", "w1": "mlp", "w2": "mlp", "w3": "mlp",
         "attn_norm": "norm", "mlp_norm": "norm"}


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    heads_kv: int = 2
    ffn: int = 128
    layers: int = 2

    @property
    def head_dim(self):
        return self.dim // self.heads


def init(cfg: Config, seed=0) -> dict:
    """{name: fp64 tensor}: layer parameters named "L{i}.{name}", plus embed, final_norm, head."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(shape[-1])
    hd = cfg.head_dim
    p = {"embed": torch.randn(cfg.vocab, cfg.dim, generator=g, dtype=torch.float64),
         "final_norm": torch.ones(cfg.dim, dtype=torch.float64), "head": w(cfg.vocab, cfg.dim)}
    for i in range(cfg.layers):
        p.update({f"L{i}.attn_norm": torch.ones(cfg.dim, dtype=torch.float64), f"L{i}.wq": w(cfg.heads * hd, cfg.dim),
                  f"L{i}.wk": w(cfg.heads_kv * hd, cfg.dim), f"L{i}.wv": w(cfg.heads_kv * hd, cfg.dim),
                  f"L{i}.wo": w(cfg.dim, cfg.heads * hd), f"L{i}.mlp_norm": torch.ones(cfg.dim, dtype=torch.float64),
                  f"L{i}.w1": w(cfg.ffn, cfg.dim), f"L{i}.w3": w(cfg.ffn, cfg.dim), f"L{i}.w2": w(cfg.dim, cfg.ffn)})
    return p


def group_of(name):
    """(layer or None, kind) of a parameter name."""
    if "." not in name:
        return None, name
    layer, kind = name.split(".")
    return int(layer[1:]), KINDS[kind]


def _rms(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x, pos):
    half = x.shape[-1] // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64, device=x.device) / half)
    ang = torch.as_tensor(pos, dtype=torch.float64, device=x.device)[:, None] * freq[None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


def loss(params, cfg, tokens, targets, pos, attn, total):
    """Sum of cross-entropy over these tokens / ``total``; tokens, targets: (B, n) int64, pos: (n,) global."""
    B, n = tokens.shape
    hd = cfg.head_dim
    h = params["embed"][tokens]
    for i in range(cfg.layers):
        x = _rms(h, params[f"L{i}.attn_norm"])
        q = (x @ params[f"L{i}.wq"].T).view(B, n, cfg.heads, hd).transpose(1, 2)
        k = (x @ params[f"L{i}.wk"].T).view(B, n, cfg.heads_kv, hd).transpose(1, 2)
        v = (x @ params[f"L{i}.wv"].T).view(B, n, cfg.heads_kv, hd).transpose(1, 2)
        o = attn(_rope(q, pos), _rope(k, pos), v).to(torch.float64)
        h = h + o.transpose(1, 2).reshape(B, n, cfg.heads * hd) @ params[f"L{i}.wo"].T
        x = _rms(h, params[f"L{i}.mlp_norm"])
        h = h + (torch.nn.functional.silu(x @ params[f"L{i}.w1"].T) * (x @ params[f"L{i}.w3"].T)) @ params[f"L{i}.w2"].T
    logits = _rms(h, params["final_norm"]) @ params["head"].T
    return torch.nn.functional.cross_entropy(logits.reshape(B * n, -1), targets.reshape(-1), reduction="sum") / total


def exact_attention(q, k, v):
    """Causal softmax attention in fp64 (grouped-query): fadev's one reference, fadev.monitor.reference_attention."""
    return reference_attention(q, k, v, is_causal=True)


class _SimulatedRing(torch.autograd.Function):
    """fadev.ring_attention (W simulated ranks, one process) as a differentiable torch op."""

    @staticmethod
    def forward(ctx, q, k, v, policy, options):
        arrays = [t.detach().numpy() for t in (q, k, v)]
        out, lse = ring_attention(*arrays, policy, return_lse=True, causal=True, **options)
        ctx.arrays, ctx.out, ctx.lse, ctx.policy, ctx.options = arrays, out, lse, policy, options
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx, dout):
        grads = ring_attention_backward(*ctx.arrays, ctx.out, ctx.lse, dout.detach().numpy(), ctx.policy,
                                        causal=True, **ctx.options)
        return tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in grads) + (None, None)


def simulated_attention(policy, world_size, layout, merge):
    options = {"world_size": world_size, "layout": layout, "merge": as_merge(merge)}
    return lambda q, k, v: _SimulatedRing.apply(q, k, v, policy, options)


def batch(cfg, batch_size, seq, seed=0):
    """(tokens, targets): (B, seq) random tokens and the next token of each."""
    rng = np.random.default_rng(seed)
    t = torch.from_numpy(rng.integers(0, cfg.vocab, (batch_size, seq + 1)))
    return t[:, :-1], t[:, 1:]


def gradients(params, cfg, tokens, targets, pos, attn, total):
    """(loss, {name: grad}) of :func:`loss`."""
    leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    value = loss(leaves, cfg, tokens, targets, pos, attn, total)
    value.backward()
    return value.detach(), {n: p.grad for n, p in leaves.items()}
