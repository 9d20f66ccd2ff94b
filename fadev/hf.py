"""Hugging Face transformers models on fadev's attention kernels. Needs ``pip install 'fadev[hf]'``.

``import fadev.hf`` registers fadev with transformers (:func:`register`): the attention function under
the name "fadev" in ``AttentionInterface``, and transformers' SDPA mask builder (:func:`mask`: it also skips a
causal mask without padding under torch.compile) under the same name in ``AttentionMaskInterface``, so a model
built with ``attn_implementation="fadev"`` hands fadev the arguments its "sdpa" implementation would get (None
where causal is enough, else a boolean (B, 1, N_q, N_kv) mask). What "fadev" computes is chosen by :class:`use`, a context manager:

* ``use(policy, kernel="flash", **tiling)`` / ``kernel="baseline"``: fadev's emulated kernels under a
  precision policy (:func:`fadev.torch.attention`; CPU or CUDA tensors, forward and backward);
* ``use(kernel="native", block_q=..., block_kv=..., ...)``: the native tensor-core kernel
  (:func:`fadev.torch_native.native_attention`; CUDA float16 / bfloat16, head dim 64 or 128);
* ``use(kernel="sdpa")``: transformers' own sdpa attention, i.e. plain
  ``torch.nn.functional.scaled_dot_product_attention`` (so SDPA-level monitors and patches see the calls).

Outside any ``use`` block the kernel is "sdpa" (the model then computes what ``attn_implementation="sdpa"``
computes). ``use`` blocks nest; the choice lives in a ``contextvars.ContextVar``, so each thread (and
asyncio task) has its own. A block with a fadev kernel in which no "fadev" attention ran warns
(:class:`UnusedBlockWarning`).

Comparing against transformers' own attention: build the reference with :func:`reference_model` (a deep copy
with its own config). transformers writes ``attn_implementation`` into the config object it is given, so a
reference built from the fadev model's config turns the fadev model into an sdpa one as well.

Masks (kernels other than "sdpa"): None with ``is_causal`` (as transformers' sdpa integration decides
it), an all-visible mask, or the causal mask run as one call; a padding mask is computed exactly, one
batch row at a time, when every query sees a prefix of that row's visible keys and those queries form a
causal chain (left or right padding of a causal LM) followed by queries seeing every visible key; a
query that sees no key gets 0, as SDPA gives. Any other mask (sliding windows, additive biases, masks
differing between heads) raises ValueError naming ``attention_mask``; attention dropout > 0 raises
ValueError naming ``dropout``, as do ``position_bias``, ``softcap`` and ``s_aux`` (sinks).

:func:`register_sdpa_flash` (done on import where PyTorch has
``torch.nn.attention.register_flash_attention_impl``) registers the native kernel as an SDPA flash
implementation: after ``torch.nn.attention.activate_flash_attention_impl("fadev")`` (or inside
``with fadev.hf.sdpa_flash():``) every SDPA call that PyTorch sends to its flash backend on CUDA runs
fadev's native forward and backward instead.
"""
from __future__ import annotations

import contextvars
import copy
import dataclasses
import threading
import warnings

import torch
import torch.nn.attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from . import _args
from .backends import subset
from .cuda import device_count, no_gpu
from .formats import boolean, integer
from .native import MMA_CHOICES
from .policy import Policy
from .torch import _Kernel, _compiled, _handle, attention as _emulated, autocast_inputs
from . import torch_native
from .torch_native import native_attention

KERNELS = subset("sdpa", "flash", "baseline", "native")
NATIVE_OPTIONS = ("block_q", "block_kv", "backward_block_q", "backward_block_kv", "deterministic", "mma",
                  "backward_mma")
"""Keyword arguments ``use(kernel="native", ...)`` takes: those of :func:`fadev.torch_native.native_attention`."""
NAME = "fadev"


# ---------------------------------------------------------------- what "fadev" computes

@dataclasses.dataclass(frozen=True)
class Setting:
    """The kernel "fadev" runs: ``kernel`` (one of KERNELS), ``policy`` (a Policy for "flash" and
    "baseline", else None) and ``tiling`` (sorted (name, value) pairs)."""

    kernel: str
    policy: Policy | None = None
    tiling: tuple = ()

    def __post_init__(self):  # the keyword arguments of each call, built once (issue 25: no per-call work)
        object.__setattr__(self, "kwargs", dict(self.tiling))
        # the emulated kernels' handle (fadev.torch._handle), computed here, outside any compiled region: under
        # torch.compile the attention passes this int, where torch 2.11's dynamo could not turn the Policy (a
        # frozen dataclass) into a constant (measured: "can't reconstruct arbitrary frozen dataclass instances")
        handle = _handle(self.policy, self.kernel, self.tiling) if self.policy is not None else None
        object.__setattr__(self, "handle", handle)


def _setting(policy, kernel, tiling) -> Setting:
    _args.choice("kernel", kernel, KERNELS)
    if kernel in ("flash", "baseline"):
        if policy is None:
            raise ValueError(f"kernel={kernel!r} needs a policy (e.g. 'fa2:bf16' or Policy.golden()), got None")
        return Setting(kernel, _Kernel.make(policy, kernel, tiling).policy, tuple(sorted(tiling.items())))
    if policy is not None:
        raise ValueError(f"kernel={kernel!r} takes no policy (its arithmetic is fixed), got policy={policy!r}")
    allowed = NATIVE_OPTIONS if kernel == "native" else ()
    unknown = sorted(set(tiling) - set(allowed))
    if unknown:
        raise TypeError(f"kernel={kernel!r} takes no tiling argument(s) {', '.join(unknown)}"
                        + (f" (it takes {', '.join(allowed)})" if allowed else ""))
    for name, value in tiling.items():
        if name == "deterministic":
            boolean(value, name)
        elif name in ("mma", "backward_mma"):
            if value is not None or name == "mma":
                _args.choice(name, value, MMA_CHOICES)
        elif value is not None:
            _args.positive_int(integer(value, name), name)
    return Setting(kernel, None, tuple(sorted(tiling.items())))


DEFAULT = Setting("sdpa")
"""The setting outside any :class:`use` block: plain SDPA."""

_CURRENT = contextvars.ContextVar("fadev.hf.setting", default=DEFAULT)


class _Mirror:
    """The innermost ``use`` block's setting and run counter, as ``_CURRENT`` and ``_RUNS`` hold them, for
    torch.compile: dynamo cannot read a ContextVar, and it reads a ``threading.local``'s class attributes, not this
    thread's values (measured: a compiled model then ran plain SDPA inside ``use(kernel="native")``). A plain
    object's attributes it reads and guards on, so a compiled model's attention reads this and a changed setting
    recompiles. One per process: threads or asyncio tasks that interleave ``use`` blocks around a compiled model
    see the latest block entered or left."""

    def __init__(self):
        self.setting = DEFAULT
        self.runs = None


_MIRROR = _Mirror()


def current() -> Setting:
    """The active :class:`Setting` of this thread / task (:data:`DEFAULT` outside any ``use`` block)."""
    return _CURRENT.get()


class use:  # noqa: N801 (a context manager)
    """``with fadev.hf.use(policy=None, *, kernel="flash", **tiling) as setting:``

    Inside the block, attention of models built with ``attn_implementation="fadev"`` is computed by
    ``kernel``: "flash" or "baseline" under ``policy`` (a Policy or a string such as "fa2:bf16";
    ``**tiling`` as :func:`fadev.torch.attention`), "native" (``block_q``, ``block_kv``,
    ``backward_block_q``, ``backward_block_kv``, ``deterministic``, ``mma``, as
    :func:`fadev.torch_native.native_attention`), or "sdpa" (plain PyTorch SDPA). Arguments are
    checked here, so a bad one raises at the ``with``. Blocks nest (the innermost wins) and are per
    thread / asyncio task; one ``use`` object may be entered again, also from several threads."""

    def __init__(self, policy=None, *, kernel="flash", **tiling):
        self.setting = _setting(policy, kernel, tiling)
        self._tokens = threading.local()

    def __enter__(self) -> Setting:
        stack = self._tokens.__dict__.setdefault("stack", [])
        runs = [0]
        stack.append((_CURRENT.set(self.setting), _RUNS.set(runs)))
        _MIRROR.setting, _MIRROR.runs = self.setting, runs
        return self.setting

    def __exit__(self, exc_type, *exc):
        token, runs = self._tokens.stack.pop()
        calls = _RUNS.get()[0]
        _CURRENT.reset(token)
        _RUNS.reset(runs)
        outer = _RUNS.get()
        _MIRROR.setting, _MIRROR.runs = _CURRENT.get(), outer
        if outer is not None:
            outer[0] += calls  # an enclosing block saw these calls too
        if exc_type is None and calls == 0 and self.setting.kernel != "sdpa":
            warnings.warn(NOT_RUN, UnusedBlockWarning, stacklevel=2)
        return False


class UnusedBlockWarning(UserWarning):
    """A ``use`` block with a fadev kernel in which no "fadev" attention ran."""


NOT_RUN = ("fadev.hf.use: no attention with attn_implementation='fadev' ran in this block, so fadev computed "
           "nothing. If a model was built as 'fadev' and a reference model from the same config, transformers wrote "
           "the reference's attn_implementation into that shared config (from_config(config, attn_implementation="
           "'sdpa') and set_attn_implementation('sdpa') switch every model of the config) and both models now run "
           "sdpa: build the reference with fadev.hf.reference_model(model) instead.")
_RUNS = contextvars.ContextVar("fadev_hf_runs", default=None)
"""[number of attention_forward calls] of the innermost ``use`` block of this thread / task (None outside)."""


def reference_model(model, attn_implementation="sdpa"):
    """A twin of ``model`` (a transformers model, e.g. built with ``attn_implementation="fadev"``) with the same
    weights and its own deep copy of the config, set to ``attn_implementation`` (default "sdpa") on the copy
    only. The comparison recipe: ``ref = fadev.hf.reference_model(model)``, then run ``model`` inside
    ``fadev.hf.use(...)`` and ``ref`` outside. Building the reference from the same config object instead
    (``from_config(model.config, attn_implementation="sdpa")``, ``set_attn_implementation``) switches ``model``
    to sdpa too, since transformers writes the choice into the config, and every comparison reads 0."""
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if not isinstance(attn_implementation, str) or not attn_implementation:
        raise TypeError(f"attn_implementation must be a non-empty string, got {attn_implementation!r}")
    twin = copy.deepcopy(model)  # the config is copied with it: every submodule of the twin shares the copy
    if twin.config is model.config:
        raise RuntimeError("reference_model: the deep copy kept the original config object")
    twin.set_attn_implementation(attn_implementation)
    return twin


# ---------------------------------------------------------------- masks

def _allowed(mask, q, k) -> torch.Tensor:
    """``mask`` as a boolean (B, N_q, N_kv) tensor, True where a query sees a key; ValueError naming
    attention_mask for one fadev cannot read exactly."""
    b, h, nq, _ = q.shape
    nk = k.shape[2]
    if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 3, 4):
        raise ValueError(f"attention_mask: expected a boolean or float tensor of rank 2 to 4, got "
                         f"{type(mask).__name__}{'' if not isinstance(mask, torch.Tensor) else tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        blocked = (mask == -float("inf")) | (mask == torch.finfo(mask.dtype).min)
        if not bool(((mask == 0) | blocked).all()):
            raise ValueError("attention_mask: a float mask with values other than 0 and -inf (or the dtype's "
                             "minimum) is an additive bias, which fadev does not compute")
        allowed = mask == 0
    else:
        raise ValueError(f"attention_mask: expected a bool or floating-point mask, got dtype {mask.dtype}")
    try:
        allowed = allowed.expand(b, h, nq, nk)
    except RuntimeError:
        raise ValueError(f"attention_mask: shape {tuple(mask.shape)} does not broadcast to (batch, heads, "
                         f"queries, keys) = {(b, h, nq, nk)}") from None
    if not bool((allowed == allowed[:, :1]).all()):
        raise ValueError("attention_mask differs between heads; fadev computes masks shared by all heads")
    return allowed[:, 0]


def _row_plan(allowed, row):
    """The exact calls for one batch row's (N_q, N_kv) mask: [(query indices, key indices, is_causal)].
    Every query must see a prefix of the visible keys K; the queries that see any key must be a causal
    chain (the t-th sees the first t keys) followed by queries that see all of K."""
    keys = allowed.any(0).nonzero().flatten()
    n = keys.numel()
    sub = allowed[:, keys]
    counts = sub.sum(1)
    prefix = torch.arange(n, device=allowed.device)[None, :] < counts[:, None]
    seeing = counts.nonzero().flatten()
    c = counts[seeing]
    chain = int((c == torch.arange(1, c.numel() + 1, device=c.device)).cumprod(0).sum())
    if not bool((sub == prefix).all()) or not bool((c[chain:] == n).all()):
        raise ValueError(f"attention_mask: batch row {row} is neither causal nor causal with padding (each query "
                         f"must see a prefix of the unpadded keys, in a causal chain); fadev computes None, "
                         f"causal and padding masks (sliding windows, chunks and custom masks are refused)")
    plan = [(seeing[:chain], keys[:chain], True)] if chain else []
    if chain < c.numel():
        plan.append((seeing[chain:], keys, False))
    return plan


# ---------------------------------------------------------------- the attention function

def _compute(setting, q, k, v, causal, scale, gqa):
    if setting.kernel == "native":
        return native_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa, **setting.kwargs)
    if torch.compiler.is_compiling():
        return _compiled(q, k, v, setting.handle, causal, scale, gqa)
    return _emulated(q, k, v, setting.policy, kernel=setting.kernel, is_causal=causal, scale=scale, enable_gqa=gqa,
                     **setting.kwargs)


def _masked(setting, q, k, v, mask, scale, gqa):
    allowed = _allowed(mask, q, k)
    nq, nk = q.shape[2], k.shape[2]
    if bool(allowed.all()):
        return _compute(setting, q, k, v, False, scale, gqa)
    if nq == nk and bool((allowed == torch.ones(nq, nk, dtype=torch.bool, device=allowed.device).tril()).all()):
        return _compute(setting, q, k, v, True, scale, gqa)
    rows = []
    for b in range(q.shape[0]):
        out = q.new_zeros(q.shape[1:3] + v.shape[3:])  # a query that sees no key: 0, as SDPA gives
        for queries, keys, causal in _row_plan(allowed[b], b):
            piece = _compute(setting, q[b:b + 1, :, queries], k[b:b + 1, :, keys], v[b:b + 1, :, keys], causal,
                             scale, gqa)
            out = out.index_copy(1, queries, piece[0])
        rows.append(out)
    return torch.stack(rows)


def _check_qkv(query, key, value):
    """ValueError / TypeError naming the argument unless query (B, H, N_q, D), key and value (B, H_kv, N_kv, D)
    are 4-D tensors as a model's attention layer passes them, H a multiple of H_kv."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D (batch, heads, seq, head_dim) tensor, got shape {tuple(t.shape)}")
    (b, h, _, d), (bk, hk, nk, dk) = query.shape, key.shape
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value: shape {tuple(value.shape)} does not match key's {tuple(key.shape)} in batch, "
                         f"heads and sequence")
    if bk != b or dk != d or hk < 1 or h % hk:
        raise ValueError(f"key: shape {tuple(key.shape)} does not fit query {tuple(query.shape)} (same batch and "
                         f"head dim, query heads a multiple of key heads)")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """The "fadev" entry of transformers' AttentionInterface: query (B, H, N_q, D), key and value
    (B, H_kv, N_kv, D) as a model's attention layer passes them; returns (attn_output (B, N_q, H, D),
    None). Computed as :func:`current` says (module docstring)."""
    _check_qkv(query, key, value)
    if torch.compiler.is_compiling():
        setting, runs = _MIRROR.setting, _MIRROR.runs
    else:
        setting, runs = _CURRENT.get(), _RUNS.get()
    if runs is not None:
        runs[0] += 1
    if setting.kernel == "sdpa":
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if dropout:
        raise ValueError(f"dropout={dropout}: fadev attention has no dropout; set the config's attention_dropout "
                         f"to 0 or call model.eval()")
    for name in ("position_bias", "softcap", "s_aux"):  # T5's bias, Gemma 2's soft cap, gpt-oss's sinks
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: fadev computes plain softmax attention (no bias, soft cap or sinks)")
    # under torch.autocast a model hands attention fp32 q, k (after the rotary embedding) and a bf16 v; SDPA
    # is one of autocast's lower-precision ops, so cast as PyTorch's SDPA (and fadev.torch.patch_sdpa) would
    query, key, value = autocast_inputs(query, key, value)
    gqa = query.shape[1] != key.shape[1]
    nq = query.shape[2]
    # as transformers' sdpa integration: is_causal only for a prefill without a mask, keys cut to the queries
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(nq > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > nq:
        key, value = key[:, :, :nq], value[:, :, :nq]
    if attention_mask is None:
        out = _compute(setting, query, key, value, causal, scaling, gqa)
    else:
        out = _masked(setting, query, key, value, attention_mask, scaling, gqa)
    return out.transpose(1, 2).contiguous(), None


def mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
         attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers' ``sdpa_mask`` (the "fadev" mask builder), except that a causal mask with no padding mask is
    skipped (None: the attention then runs is_causal) under torch.compile too, where transformers before torch 2.14
    never skips: nothing data-dependent decides it, and a materialised mask would make fadev read its values on
    the host (a graph break per layer). The conditions are transformers' own eager ones (q_length 1 or equal to
    kv_length, or an empty cache's prefill, no sliding window within reach)."""
    if (allow_is_causal_skip and attention_mask is None and mask_function is causal_mask_function
            and not isinstance(q_offset, torch.Tensor) and (local_size is None or kv_length < local_size)
            and (q_length == 1 or kv_length == q_length or q_offset == 0)):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def register(name=NAME) -> None:
    """Register :func:`attention_forward` (AttentionInterface) and transformers' SDPA mask builder
    (AttentionMaskInterface: :func:`mask`) under ``name``; idempotent. Done for "fadev" on import."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask)


# ---------------------------------------------------------------- an SDPA flash implementation

def _flash_check(query, key, value, dropout_p, return_debug_mask, is_causal, scale, options):
    """The native plan (fadev.torch_native.Plan) of this flash call; RuntimeError saying why it cannot."""
    why = ("dropout_p must be 0" if dropout_p else "return_debug_mask must be False" if return_debug_mask
           else None)
    if why is None:
        try:
            gqa = query.dim() == 4 == key.dim() and query.shape[1] != key.shape[1]
            return torch_native.plan(query, key, value, is_causal, scale, gqa, *options)
        except (TypeError, ValueError) as e:
            why = str(e)
    raise RuntimeError(f"fadev's SDPA flash implementation cannot compute this call: {why}. Call "
                       f"torch.nn.attention.restore_flash_attention_impl() for PyTorch's own kernel, or choose another "
                       f"backend with torch.nn.attention.sdpa_kernel")


def _flash_ops(options):
    """aten._scaled_dot_product_flash_attention and its backward on the native kernel; ``options``:
    (block_q, block_kv, backward_block_q, backward_block_kv, deterministic)."""

    def forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        plan = _flash_check(query, key, value, dropout_p, return_debug_mask, is_causal, scale, options)
        out, lse = torch_native.run_forward(plan, query.contiguous(), key.contiguous(), value.contiguous())
        dev = query.device
        return (out, lse, None, None, query.shape[2], key.shape[2], torch.zeros(2, dtype=torch.uint64, device=dev),
                torch.zeros((), dtype=torch.uint64, device=dev), torch.empty(0, dtype=query.dtype, device=dev))

    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, philox_seed, philox_offset, *, scale=None):
        plan = _flash_check(query, key, value, dropout_p, False, is_causal, scale, options)
        q, k, v, o, lse = (t.contiguous() for t in (query, key, value, out, logsumexp))
        return torch_native.run_backward(plan, q, k, v, o, lse, grad_out)

    return forward, backward


@dataclasses.dataclass
class _FlashHandle:
    """What activation registered with the dispatcher; ``remove`` deregisters it."""

    library: object

    def remove(self) -> None:
        if self.library is not None:
            destroy = getattr(self.library, "_destroy", None)  # else the Library deregisters when collected
            if destroy is not None:
                destroy()
            self.library = None


def _activate_flash(options):
    if not device_count():
        raise no_gpu("fadev's SDPA flash implementation")
    forward, backward = _flash_ops(options)
    lib = torch.library.Library("aten", "IMPL", "CUDA")  # noqa: TOR901 (an override of aten's CUDA kernels)
    lib.impl("_scaled_dot_product_flash_attention", forward, "CUDA")
    lib.impl("_scaled_dot_product_flash_attention_backward", backward, "CUDA")
    return _FlashHandle(lib)


def register_sdpa_flash(name=NAME, *, block_q=None, block_kv=None, backward_block_q=None, backward_block_kv=None,
                        deterministic=True) -> None:
    """Register the native kernel (tiles and ``deterministic`` as :func:`fadev.torch_native.native_attention`)
    with ``torch.nn.attention.register_flash_attention_impl`` under ``name``; idempotent (the last
    registration of a name wins). Activating it
    (``torch.nn.attention.activate_flash_attention_impl(name)``, or :func:`sdpa_flash`) overrides the
    CUDA kernels of ``aten._scaled_dot_product_flash_attention`` and its backward: SDPA calls that PyTorch
    routes to its flash backend then run fadev's native forward and backward (float16 / bfloat16, head
    dim 64 or 128, no dropout); other flash calls raise RuntimeError saying why (there is no fallback to
    PyTorch's own flash kernel, which the override replaces; torch's FA4 registration refuses the same
    way). Activation needs a GPU fadev can use. RuntimeError where PyTorch has no
    register_flash_attention_impl."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    tiles = ((block_q, "block_q"), (block_kv, "block_kv"), (backward_block_q, "backward_block_q"),
             (backward_block_kv, "backward_block_kv"))
    options = tuple(None if t is None else integer(t, n) for t, n in tiles)
    options += (boolean(deterministic, "deterministic"),)
    registry = getattr(torch.nn.attention, "register_flash_attention_impl", None)
    if registry is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.register_flash_attention_impl: "
                           f"use fadev.hf.use(kernel='native') or fadev.torch_native.native_attention instead")
    registry(name, register_fn=lambda: _activate_flash(options))


class sdpa_flash:  # noqa: N801 (a context manager)
    """``with fadev.hf.sdpa_flash(name="fadev"):`` activates the SDPA flash implementation ``name``
    (registered by :func:`register_sdpa_flash`) and restores PyTorch's default flash kernel on exit."""

    def __init__(self, name=NAME):
        self.name = name

    def __enter__(self):
        torch.nn.attention.activate_flash_attention_impl(self.name)
        return self

    def __exit__(self, *exc):
        torch.nn.attention.restore_flash_attention_impl()
        return False


def has_sdpa_flash_registry() -> bool:
    """True where PyTorch offers ``torch.nn.attention.register_flash_attention_impl``."""
    return hasattr(torch.nn.attention, "register_flash_attention_impl")


register()
if has_sdpa_flash_registry():
    register_sdpa_flash()

__all__ = ["use", "current", "Setting", "DEFAULT", "KERNELS", "NATIVE_OPTIONS", "attention_forward", "register",
           "reference_model", "UnusedBlockWarning",
           "register_sdpa_flash", "sdpa_flash", "has_sdpa_flash_registry"]
