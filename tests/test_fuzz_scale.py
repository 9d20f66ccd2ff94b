"""tests/test_fuzz.py's boundary fuzzing (its strategies, ``rejects`` and example budget) on the scale paths:
fadev.distributed (ring_attention on a one-rank gloo group in this process, shard, unshard), fadev.hf (use,
attention_forward) and the sweep executors (their options; chunks on an executor that loses futures, and
points that raise). Valid input: the right shape and dtype, inputs unchanged, the one-rank ring equal to
the simulation bit for bit, every sweep point exactly one row (failed exactly where it must be); invalid
input: TypeError or ValueError naming the argument."""
from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fadev
from fadev.sweep import executors
from test_fuzz import (KERNEL_ARGS, NON_BOOLS, NON_INTS, SCALE, _outcome_report, attention_inputs, called,  # noqa: F401
                       rejects)

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from fadev import distributed as fd  # noqa: E402

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
NOT_FLOAT = (torch.complex64, torch.complex128, torch.bool, torch.int32, torch.int8, torch.uint8)


# ---------------------------------------------------------------- fadev.distributed

@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo process group in this process (destroyed after the module: other tests expect none)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tensors(qkv, dtype):
    """(q, k, v) as leaf tensors of ``dtype``, rows doubled (zigzag needs an even count)."""
    return [torch.tensor(np.concatenate([np.asarray(x, dtype=np.float64)] * 2, axis=-2)).to(dtype).requires_grad_()
            for x in qkv]


@SCALE
@given(attention_inputs(same_len=True), st.sampled_from(DTYPES), st.sampled_from(fadev.ring.LAYOUTS),
       st.sampled_from(fadev.ring.MERGES), st.booleans(), st.sampled_from(("emulated", "sdpa")))
def test_distributed_ring_valid(one_rank, qkv, dtype, layout, merge, causal, kernel):
    q, k, v = _tensors(qkv, dtype)
    before = [t.detach().clone() for t in (q, k, v)]
    out, lse = fd.ring_attention(q, k, v, "fa2:bf16", layout=layout, merge=merge, causal=causal, kernel=kernel,
                                 return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:-1]
    out.float().sum().backward()
    called(fd.ring_attention, 2)
    assert [t.grad.shape for t in (q, k, v)] == [q.shape, k.shape, v.shape]
    assert all(torch.equal(a, b.detach()) or torch.isnan(a).any() for a, b in zip(before, (q, k, v)))
    if kernel == "emulated":  # one rank: the simulation's bits (cast to the inputs' dtype as the ring casts)
        want = fadev.ring_attention(*(t.detach().double().numpy() for t in (q, k, v)), "fa2:bf16", world_size=1,
                                    layout=layout, merge=merge, causal=causal)
        assert torch.equal(out.detach().view(-1).view(torch.uint8),
                           torch.from_numpy(want).to(dtype).view(-1).view(torch.uint8))


DIST_ARGS = {  # argument -> strategy of invalid values for it
    "q": st.one_of(st.sampled_from(NOT_FLOAT), st.sampled_from([np.ones((4, 4)), "q", None, torch.ones(2, 2, 2, 4, 4),
                                                                 torch.ones(4)])),
    "k": st.one_of(st.sampled_from(NOT_FLOAT), st.just(torch.ones(6, 4))), "v": st.sampled_from(NOT_FLOAT),
    "kernel": st.sampled_from(["fast", None, 3, ""]), "layout": st.sampled_from(["spiral", None, 1]),
    "merge": st.sampled_from(["nope", 3, None]), "policy": KERNEL_ARGS["policy"], "causal": NON_BOOLS,
    "return_lse": NON_BOOLS, "scale": KERNEL_ARGS["scale"], "block_q": KERNEL_ARGS["block_q"],
    "loop_order": KERNEL_ARGS["loop_order"], "exp": KERNEL_ARGS["exp"],
}


@SCALE
@given(st.sampled_from(sorted(DIST_ARGS)), st.data())
def test_distributed_ring_invalid(one_rank, arg, data):
    q = torch.zeros(4, 4)
    args = {"q": q, "k": q, "v": q, "policy": "fa2:bf16", "kernel": "emulated", "layout": "zigzag",
            "merge": "lowp_partials", "causal": False, "return_lse": False, "scale": None, "block_q": None,
            "loop_order": None, "exp": None}
    bad = data.draw(DIST_ARGS[arg])
    args[arg] = q.to(bad) if isinstance(bad, torch.dtype) else bad
    rejects(arg, fd.ring_attention, *(args.pop(n) for n in ("q", "k", "v", "policy")), **args)


@SCALE
@given(st.integers(1, 4), st.sampled_from(fadev.ring.LAYOUTS), st.integers(1, 3), st.data())
def test_shard_unshard(world, layout, per, data):
    n = 2 * world * per
    x = np.arange(2 * n * 3, dtype=np.float64).reshape(2, n, 3)
    parts = [fd.shard(x, world, r, layout=layout) for r in range(world)]
    assert np.array_equal(fd.unshard(parts, layout=layout), x)
    t = torch.tensor(x)
    assert torch.equal(fd.unshard([fd.shard(t, world, r, layout=layout) for r in range(world)], layout=layout), t)
    called(fd.shard, 2 * world)
    called(fd.unshard, 2)
    rejects("rank", fd.shard, x, world, data.draw(st.sampled_from([world, -1, 2.5, True, "0", None])), layout=layout)
    bad_world = data.draw(NON_INTS.filter(lambda w: w is not None) | st.just(0))
    rejects("world_size", fd.shard, x, bad_world, 0, layout=layout)
    rejects("layout", fd.shard, x, world, 0, layout=data.draw(st.sampled_from(["spiral", None, 2])))
    rejects("x", fd.shard, data.draw(st.sampled_from([x[0, :, 0], x[:, :-1]])), 2, 0, layout=layout)  # 1-D; N odd
    rejects("parts", fd.unshard, [x, x[..., :1]], layout=layout)
    rejects("layout", fd.unshard, parts, layout="spiral")


# ---------------------------------------------------------------- fadev.hf

hf = None


def _hf():
    global hf
    if hf is None:
        pytest.importorskip("transformers")
        import fadev.hf as module
        hf = module
    return hf


FLASH_TILING = {"block_q": st.integers(1, 8), "block_kv": st.integers(1, 8), "loop_order": st.sampled_from(
    ("q_outer", "kv_outer")), "normalize": st.sampled_from(("deferred", "eager")), "exp": st.sampled_from(
    ("exp", "exp2"))}
BAD_TILING = {"block_q": KERNEL_ARGS["block_q"], "block_kv": KERNEL_ARGS["block_q"],
              "sram_bytes": st.sampled_from([0, -1, 2.5, True, "4096"]), "loop_order": KERNEL_ARGS["loop_order"],
              "normalize": st.sampled_from(["later", 0]), "exp": KERNEL_ARGS["exp"]}


class Causal:
    is_causal = True


class Full:
    is_causal = False


@pytest.mark.filterwarnings("ignore::UserWarning")  # UnusedBlockWarning: these blocks run no attention on purpose
@SCALE
@given(st.sampled_from(("flash", "baseline", "native", "sdpa")), st.data())
def test_hf_use(kernel, data):
    h = _hf()
    policy = data.draw(st.sampled_from(("fa2:bf16", "golden", "paper:fp16"))) if kernel in ("flash", "baseline") \
        else None
    names = data.draw(st.sets(st.sampled_from(sorted(FLASH_TILING)), max_size=3)) if kernel == "flash" else ()
    tiling = {n: data.draw(FLASH_TILING[n]) for n in names}
    if kernel == "native":
        tiling = {"block_q": data.draw(st.sampled_from((64, 128))), "deterministic": data.draw(st.booleans())}
    with h.use(policy, kernel=kernel, **tiling) as setting:
        assert h.current() is setting and setting.kernel == kernel and dict(setting.tiling) == tiling
    assert h.current() == h.DEFAULT
    called(h.use)
    if kernel == "flash":
        arg = data.draw(st.sampled_from(sorted(BAD_TILING) + ["policy", "kernel"]))
        if arg == "policy":
            rejects("policy", h.use, data.draw(KERNEL_ARGS["policy"]), kernel=kernel)
        elif arg == "kernel":
            rejects("kernel", h.use, policy, kernel=data.draw(st.sampled_from(["fast", None, 3])))
        else:
            rejects(arg, h.use, policy, **{arg: data.draw(BAD_TILING[arg])})
    elif kernel == "native":
        arg = data.draw(st.sampled_from(("block_q", "block_kv", "backward_block_q", "deterministic", "mma")))
        bad = {"deterministic": NON_BOOLS, "mma": st.sampled_from(["tensor", 3])}.get(arg, KERNEL_ARGS["block_q"])
        rejects(arg, h.use, kernel=kernel, **{arg: data.draw(bad.filter(lambda b: b is not None))})
    else:
        rejects("policy", h.use, "fa2:bf16", kernel="sdpa") if kernel == "sdpa" else \
            rejects("policy", h.use, None, kernel=kernel)


@SCALE
@given(st.sampled_from(("flash", "baseline", "sdpa")), st.integers(1, 2), st.integers(1, 2), st.integers(1, 2),
       st.integers(1, 5), st.integers(1, 5), st.integers(1, 8), st.data())
def test_hf_attention_forward(kernel, b, hkv, groups, nq, nk, d, data):
    h = _hf()
    g = torch.Generator().manual_seed(nq * 100 + nk * 10 + d)
    q = torch.randn(b, hkv * groups, nq, d, generator=g)
    k, v = (torch.randn(b, hkv, nk, d, generator=g) for _ in range(2))
    policy = None if kernel == "sdpa" else "fa2:bf16"
    module = data.draw(st.sampled_from((Causal, Full)))()
    module.num_key_value_groups = groups  # what transformers' sdpa integration reads from a model's layer
    with h.use(policy, kernel=kernel):
        if module.is_causal and 1 < nq and nk < nq and kernel != "sdpa":
            # more queries than keys: SDPA's top-left causal mask is not fadev's bottom-right one (refused)
            rejects("is_causal", h.attention_forward, module, q, k, v, None)
            module.is_causal = False
        out, weights = h.attention_forward(module, q, k, v, None)
        called(h.attention_forward)
        assert out.shape == (b, nq, hkv * groups, d) and weights is None and out.dtype == q.dtype
        arg = data.draw(st.sampled_from(("query", "key", "value")))
        t = {"query": q, "key": k, "value": v}[arg]
        shape = data.draw(st.sampled_from((t.shape[1:], t.shape[2:], (1,) + tuple(t.shape), t.shape[-1:])))
        bad = data.draw(st.sampled_from((t.reshape(-1)[:1].expand(*shape) if shape else t, t.numpy(), None)))
        args = {"query": q, "key": k, "value": v, arg: bad}
        rejects(arg, h.attention_forward, module, args["query"], args["key"], args["value"], None)


# ---------------------------------------------------------------- the sweep executors

def _row(point):
    if point["fails"]:
        raise ArithmeticError(f"point {point['i']} fails")
    return {"key": _key(point), "i": point["i"]}


def _key(point):
    return f"p{point['i']}"


class Lossy(concurrent.futures.ThreadPoolExecutor):
    """Loses a chunk's future (as a dead worker would) as many times as ``losses`` says for its first point."""

    def __init__(self, losses):
        super().__init__(2)
        self.losses, self.seen = losses, collections_counter()

    def submit(self, fn, *args, **kwargs):
        first = args[2][0]["i"]
        self.seen[first] += 1
        if self.seen[first] <= self.losses.get(first, 0):
            lost = concurrent.futures.Future()
            lost.set_exception(EOFError("worker lost"))
            return lost
        return super().submit(fn, *args, **kwargs)


def collections_counter():
    import collections
    return collections.Counter()


@SCALE
@given(st.integers(0, 12), st.integers(1, 4), st.data())
def test_executor_rows(n, workers, data):
    """Every point exactly one row, whatever raises and whatever is lost: its own row, or a failed row
    naming why (the point raised; its chunk was lost more than MAX_RETRIES times)."""
    fails = data.draw(st.sets(st.integers(0, max(n - 1, 0)), max_size=n)) if n else set()
    points = [{"i": i, "fails": i in fails} for i in range(n)]
    losses = {i: data.draw(st.integers(0, executors.MAX_RETRIES + 1)) for i in range(n)}
    with Lossy(losses) as pool:
        rows = [r for chunk in executors.execute(points, _row, _key, lambda p: 0, executor=pool, workers=workers)
                for r in chunk]
    called(executors.execute)
    assert sorted(r["key"] for r in rows) == sorted(_key(p) for p in points)
    lost = {i for chunk in executors.chunks(points, workers, lambda p: 0)
            for i in [p["i"] for p in chunk] if losses[chunk[0]["i"]] > executors.MAX_RETRIES}
    for r in rows:
        i = int(r["key"][1:])
        want = "EOFError: worker lost" if i in lost else f"ArithmeticError: point {i} fails" if i in fails else None
        assert r.get("error") == want, (i, r)


EXECUTOR_ARGS = {
    "executor": st.sampled_from(["dask", "", 3, None, concurrent.futures.Future()]),
    "workers": st.sampled_from([0, -1, 2.5, True, "2"]),
    "address": st.sampled_from([5, 2.5, b"auto", "", "nonsense", "host:", ":10001", "127.0.0.1:70000", ["auto"]]),
    "gpus_per_point": st.sampled_from([0, -1, "1", True, float("nan")]),
    "out": st.sampled_from([5, 2.5, b"r.jsonl", ["r.jsonl"], object()]),
}


@SCALE
@given(st.sampled_from(sorted(EXECUTOR_ARGS)), st.data())
def test_executor_options_invalid(arg, data):
    from fadev import sweep
    options = {"executor": "ray" if arg in ("address", "gpus_per_point") else "local",
               arg: data.draw(EXECUTOR_ARGS[arg])}
    out = options.pop("out", None)
    rejects(arg, sweep.drive, {"p0": {"i": 0, "fails": False}}, _row, _key, out, progress=False, **options)
