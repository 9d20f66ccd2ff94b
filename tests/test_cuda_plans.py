"""Repeated emulated calls replayed from a plan (fadev.cuda_plans): a second call with the same arguments skips the
full path (fadev.cuda.route is never called: patched here to fail) and gives the full path's bits; any argument
that differs in value, type, layout, dtype or stream takes the full path again (route is called), which raises
the errors it always raised.

Skipped without a CUDA device, as in CI.
"""
import numpy as np
import pytest

import fadev
import helpers
from fadev import cuda as fcuda
from fadev import cuda_plans
from fadev.policy import Policy
from helpers import make_qkv, needs_gpu

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, needs_gpu]


class Routed(Exception):
    """fadev.cuda.route was called: the call took the full path."""


@pytest.fixture
def plans(monkeypatch):
    """Plans cleared; ``plans.route_fails()`` makes the full path fail from then on (its route raises Routed)."""
    cuda_plans.clear()

    class Switch:
        @staticmethod
        def route_fails():
            def boom(*args, **kwargs):
                raise Routed
            monkeypatch.setattr(fcuda, "route", boom)

        @staticmethod
        def route_works():
            monkeypatch.undo()

    yield Switch
    cuda_plans.clear()


def tensors(seed, shape, heads_kv=None):
    q, k, v = make_qkv(seed, shape[0], shape[1], heads_kv or shape[1], shape[2], shape[2], shape[3], spread=2.0)
    dout = make_qkv(seed + 1, *shape[:2], shape[1], shape[2], shape[2], shape[3])[0]
    return tuple(torch.from_numpy(x).cuda() for x in (q, k, v, dout))


def calls(kind, pol, causal):
    """forward(q, k, v) -> (out, lse) and backward(q, k, v, out, lse, dout) -> grads of one kind."""
    if kind == "golden":
        return lambda q, k, v: fadev.golden_attention(q, k, v, causal=causal, return_lse=True), None
    fwd = fadev.flash_attention if kind == "flash" else fadev.baseline_attention
    bwd = fadev.flash_attention_backward if kind == "flash" else fadev.baseline_attention_backward
    return (lambda q, k, v: fwd(q, k, v, pol, causal=causal, return_lse=True),
            lambda q, k, v, o, l, d: bwd(q, k, v, o, l, d, pol, causal=causal))


def same(got, want, what):
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        helpers.assert_same_bits(g.cpu().numpy(), w.cpu().numpy(), name, what, nan="any",
                                 names=("replayed", "full path"))


@pytest.mark.parametrize("kind,preset", [("flash", "fa2"), ("flash", "paper"), ("baseline", "naive"),
                                         ("golden", None)])
@pytest.mark.parametrize("causal", [False, True])
def test_replay_is_the_full_path(plans, kind, preset, causal):
    q, k, v, dout = tensors(51, (2, 4, 130, 64), heads_kv=2)
    # a Policy object: the key names it by identity; a preset string by its text
    pol = Policy.preset(preset, "bf16") if preset else None
    for policy in ((pol, f"{preset}:bf16") if preset else (None,)):
        fwd, bwd = calls(kind, policy, causal)
        want = fwd(q, k, v)
        if bwd:
            want = want + bwd(q, k, v, *want, dout)
        torch.cuda.synchronize()
        plans.route_fails()
        got = fwd(q, k, v)
        if bwd:
            got = got + bwd(q, k, v, *got, dout)
        same(got, want, f"{kind} {policy} causal={causal}")
        plans.route_works()


def test_replay_shapes_and_forms(plans):
    """Ranks 2 and 3, a forward without its lse: the replayed results have the full path's shapes and bits."""
    q, k, v, _ = tensors(53, (1, 2, 77, 40))
    for args in ((q[0, 0], k[0, 0], v[0, 0]), (q[0], k[0], v[0])):
        args = tuple(t.contiguous() for t in args)
        for lse in (False, True):
            want = fadev.flash_attention(*args, "fa2:fp16", return_lse=lse)
            plans.route_fails()
            got = fadev.flash_attention(*args, "fa2:fp16", return_lse=lse)
            plans.route_works()
            got, want = (x if lse else (x,) for x in (got, want))
            assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
            same(got, want, f"rank {args[0].dim()} return_lse={lse}")


def test_what_takes_the_full_path(plans):
    """Every difference from the plan's call: the full path runs (route is called) and checks as it always did."""
    q, k, v, _ = tensors(55, (1, 2, 64, 32))
    pol = Policy.fa2("bf16")
    fadev.flash_attention(q, k, v, pol, causal=True)
    plans.route_fails()
    fadev.flash_attention(q, k, v, pol, causal=True)  # replayed
    other = [
        lambda: fadev.flash_attention(q, k, v, pol, causal=1),  # the same value, another type
        lambda: fadev.flash_attention(q, k, v, pol, causal=False),
        lambda: fadev.flash_attention(q, k, v, Policy.fa2("bf16"), causal=True),  # an equal policy, another object
        lambda: fadev.flash_attention(q, k, v, "fa2:bf16", causal=True),
        lambda: fadev.flash_attention(q, k, v, pol, causal=True, block_q=64),
        lambda: fadev.flash_attention(q, k, v, pol, causal=True, device="cuda"),
        lambda: fadev.flash_attention(q.float(), k, v, pol, causal=True),  # another dtype
        lambda: fadev.flash_attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, pol, causal=True),
        lambda: fadev.flash_attention(q[:, :, :32], k, v, pol, causal=False),  # another shape
        lambda: fadev.flash_attention(q._neg_view(), k, v, pol, causal=True),  # a negative view
        lambda: fadev.flash_attention(q.cpu(), k.cpu(), v.cpu(), pol, causal=True),
    ]
    for call in other:
        with pytest.raises(Routed):
            call()
    side = torch.cuda.Stream()  # another current stream: the synchronous path
    with torch.cuda.stream(side), pytest.raises(Routed):
        fadev.flash_attention(q, k, v, pol, causal=True)
    plans.route_works()
    with pytest.raises(TypeError, match="causal"):
        fadev.flash_attention(q, k, v, pol, causal=1)


def test_plans_are_bounded(plans):
    q, k, v, _ = tensors(57, (1, 1, 40, 16))
    for i in range(cuda_plans._LIMIT + 5):
        fadev.flash_attention(q, k, v, "fa2:bf16", scale=0.1 + i * 1e-3)
    assert len(cuda_plans._PLANS) == cuda_plans._LIMIT
    want = fadev.flash_attention(q, k, v, "fa2:bf16", scale=0.25, device="cuda")
    got = fadev.flash_attention(q, k, v, "fa2:bf16", scale=0.25)
    np.testing.assert_array_equal(got.cpu().numpy(), want.cpu().numpy())


@pytest.mark.parametrize("kind", ["baseline", "flash"])
def test_late_outputs(plans, kind):
    """An emulated forward's replay gives the binding a callable for its outputs (fadev_late_outputs), called once the
    inputs' rounding is queued: the call returns the callable's value with the full path's bits. A callable that
    raises, returns something else, or gives a null out pointer fails the call with a clear exception, and the next
    call (whose rounding follows the failed call's on the stream) still gives the full path's bits."""
    q, k, v, _ = tensors(59, (1, 3, 96, 48))
    fwd = fadev.flash_attention if kind == "flash" else fadev.baseline_attention
    want = fwd(q, k, v, "fa2:bf16" if kind == "flash" else "naive:bf16", causal=True, return_lse=True)
    (plan,) = cuda_plans._PLANS.values()
    assert plan.late
    ptrs = tuple(t.data_ptr() for t in (q, k, v))

    def call(alloc):
        return plan.entry(*ptrs, alloc, plan.shape, plan.c, 0)

    asked = []

    def alloc():
        asked.append(1)
        return cuda_plans._results(q.new_empty, plan.results)

    got = call(alloc)
    assert len(asked) == 1 and isinstance(got, tuple) and len(got) == 2
    same(got, want, f"{kind} late outputs")

    class Refused(Exception):
        pass

    def refuse():
        raise Refused("no memory for you")

    with pytest.raises(Refused):
        call(refuse)
    with pytest.raises(TypeError, match="outputs' callable must return"):
        call(lambda: (1, 2, 3))
    with pytest.raises(TypeError, match="outputs' callable must return"):
        call(lambda: ((q.data_ptr(),), None))  # one pointer, not two
    with pytest.raises(TypeError, match="device pointer must be an int"):
        call(lambda: (("out", "lse"), None))
    with pytest.raises(ValueError):
        call(lambda: ((0, 0), None))  # a null out
    with pytest.raises(TypeError, match="outputs' callable, shape, call, stream"):
        plan.entry(*ptrs, alloc, plan.shape, plan.c)  # the callable form is queued only
    plans.route_fails()
    got = fwd(q, k, v, "fa2:bf16" if kind == "flash" else "naive:bf16", causal=True, return_lse=True)
    same(got, want, f"{kind} after the failed calls")
