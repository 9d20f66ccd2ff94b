"""Policy: presets as docs/design.md's policy table, replace(), value semantics, as_policy strings, errors."""
import dataclasses

import numpy as np
import pytest

from fadev import formats
from fadev.policy import STAGES, Policy, as_policy

# docs/design.md, the policy table. F = the preset's format; A = fp32 when F is narrower than fp32, else F;
# W = the table's "fp32" column of the fused-kernel presets, read as fp32 or F where F is wider
# (an fp64 kernel does not downcast its registers to fp32).
TABLE_STAGES = ("input", "score_acc", "score", "softmax", "sum_acc", "stats", "rescale", "p", "pv_acc",
                "out_acc", "out")
TABLE = {
    "paper": "F A F F A F F F A F F",
    "naive": "F A F A A A A F A A F",
    "fa2": "F W W W W W W F W W F",
    "fa1": "F W W W W W W F W W F",
    "efficient": "F W W W W W W F W W F",
    "cudnn": "F W W W W W W F W W F",
    "torch_math": "F W W W W W W W W W F",
}
TILING = {  # preset: (block_q, block_kv, loop_order, normalize, exp, state)
    "paper": (64, 64, "q_outer", "deferred", "exp", None),
    "naive": (64, 64, "q_outer", "deferred", "exp", None),
    "fa2": (128, 64, "q_outer", "deferred", "exp2", None),
    "fa1": (128, 128, "kv_outer", "eager", "exp", "F"),
    "efficient": (64, 64, "q_outer", "deferred", "exp", None),
    "cudnn": (64, 64, "q_outer", "deferred", "exp2", None),
    "torch_math": (64, 64, "q_outer", "deferred", "exp", None),
}
PRESET_FORMATS = ("bf16", "fp16", "fp32", "fp64", "tf32", "fp8_e4m3", "fp8_e5m2")


def expected_format(letter, F):
    wide = formats[F].precision >= 24
    if letter == "F":
        return F
    return F if wide else "fp32"  # A and W agree: fp32 unless F is fp32 or wider


@pytest.mark.parametrize("fmt", PRESET_FORMATS)
@pytest.mark.parametrize("preset", sorted(TABLE))
def test_preset_stages_match_design_table(preset, fmt):
    pol = Policy.preset(preset, fmt)
    want = {stage: expected_format(letter, fmt) for stage, letter in zip(TABLE_STAGES, TABLE[preset].split())}
    got = {stage: getattr(pol, stage).name for stage in TABLE_STAGES}
    assert got == want, f"{preset}({fmt})"
    block_q, block_kv, loop_order, normalize, exp, state = TILING[preset]
    assert (pol.block_q, pol.block_kv, pol.loop_order, pol.normalize, pol.exp) == \
        (block_q, block_kv, loop_order, normalize, exp), f"{preset}({fmt})"
    assert (pol.state.name if pol.state is not None else None) == (fmt if state == "F" else None)
    assert pol.rounding == "rne" and pol.seed == 0
    assert pol.name == f"{preset}({fmt})"
    assert getattr(Policy, preset)(fmt) == pol


def test_backward_defaults_and_bwd_scale():
    """None backward stages derive from the forward's; dsoft_p from dsoft (so R_dsoft_p(P) then R_dsoft is one
    rounding); bwd_scale is checked, compared, and named in a replaced policy's name."""
    pol = Policy(**{s: "bf16" for s in STAGES if s != "state"}, state=None, dsoft="fp16")
    assert pol.dsoft_p.name == "fp16" and pol.bwd_p.name == "bf16" and pol.bwd_scale == "sums"
    assert Policy(**{s: "fp32" for s in STAGES if s != "state"}, state=None).dsoft_p.name == "fp32"
    assert Policy.fa2("bf16").replace(bwd_scale="ds") != Policy.fa2("bf16")
    assert Policy.fa2("bf16").replace(bwd_scale="ds").name == "fa2(bf16)+bwd_scale=ds"
    assert Policy.efficient("bf16")._c_backward[-1] == 1 and Policy.fa2("bf16")._c_backward[-1] == 0
    with pytest.raises(ValueError, match="bwd_scale must be one of"):
        Policy.fa2("bf16").replace(bwd_scale="dq")


def test_golden_is_fp64_everywhere():
    pol = Policy.golden()
    assert all(getattr(pol, s) is formats["fp64"] for s in STAGES if s != "state")
    assert pol.state is None and pol.name == "golden"
    assert Policy.preset("golden") == pol


def test_stage_names_and_order():
    assert STAGES == ("input", "score_acc", "score", "softmax", "sum_acc", "stats", "rescale", "p", "pv_acc",
                      "out_acc", "state", "out")


def test_replace_changes_one_stage_and_leaves_original():
    base = Policy.fa2("bf16")
    pol = base.replace(p="fp32")
    assert pol.p is formats["fp32"]
    assert base.p is formats["bf16"]
    for s in STAGES:
        if s != "p":
            assert getattr(pol, s) == getattr(base, s), s
    assert (pol.block_q, pol.block_kv, pol.exp) == (base.block_q, base.block_kv, base.exp)
    assert pol.name == "fa2(bf16)+p=fp32"
    assert base.replace(block_kv=128).block_kv == 128
    assert base.replace(block_kv=128).name == "fa2(bf16)"  # tiling is not part of the numeric name
    assert base.replace(score=formats["fp16"]).score is formats["fp16"]
    assert base.replace(rounding="stochastic", seed=7).rounding == "stochastic"


def test_immutable():
    pol = Policy.paper("bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        pol.p = formats["fp32"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        pol.block_kv = 3


def test_equality_and_hash_by_value():
    a, b = Policy.fa2("bf16"), Policy.fa2("bf16")
    assert a is not b and a == b and hash(a) == hash(b)
    assert a != Policy.fa2("fp16")
    assert a != a.replace(block_kv=32)
    assert a.replace(seed=3) == Policy.fa2("bf16").replace(seed=3)
    assert Policy.paper("bfloat16") == Policy.paper("bf16")  # format aliases resolve to the same Format
    assert len({a, b, Policy.fa1("bf16")}) == 2
    assert a.replace(p="bf16") == a  # the name is a label: numerically identical policies are equal
    assert a.replace(seed=np.int64(3), block_kv=np.int32(32)) == a.replace(seed=3, block_kv=32)


def test_str_names_every_stage():
    text = str(Policy.fa2("bf16"))
    assert text == ("Policy[fa2(bf16)](input=bf16 score_acc=fp32 score=fp32 softmax=fp32 sum_acc=fp32 stats=fp32 "
                    "rescale=fp32 p=bf16 pv_acc=fp32 out_acc=fp32 out=bf16, rounding=rne)")
    assert "state=bf16" in str(Policy.fa1("bf16"))


@pytest.mark.parametrize("text, want", [
    ("fa2:bf16", Policy.fa2("bf16")),
    ("paper(fp16)", Policy.paper("fp16")),
    ("golden", Policy.golden()),
    (" naive : fp8_e4m3 ", Policy.naive("fp8_e4m3")),
    ("torch_math(bfloat16)", Policy.torch_math("bf16")),
    ("fa1:fp32", Policy.fa1("fp32")),
])
def test_as_policy_strings(text, want):
    assert as_policy(text) == want


def test_as_policy_passes_policies_through():
    pol = Policy.fa2("fp16")
    assert as_policy(pol) is pol


def test_state_resolution():
    pol = Policy.fa2("bf16")
    assert pol.state is None
    assert pol.state_out is pol.out_acc and pol.state_stats is pol.stats
    assert pol.stages()["state"] is None
    low = pol.replace(state="bf16")
    assert low.state_out is formats["bf16"] and low.state_stats is formats["bf16"]
    c = low._c
    assert c[10] == formats["bf16"]._c and c[11] == formats["bf16"]._c
    assert pol._c[10] == pol.out_acc._c and pol._c[11] == pol.stats._c
    assert pol._c[-2:] == (0, 0)
    assert Policy.fa2("bf16").replace(rounding="rtz", seed=9)._c[-2:] == (1, 9)


# ------------------------------------------------------------ errors name the parameter

def test_replace_unknown_stage():
    with pytest.raises(ValueError, match="scores"):
        Policy.golden().replace(scores="fp32")


@pytest.mark.parametrize("call, exc, match", [
    (lambda: Policy.preset("flash3", "bf16"), ValueError, "preset.*flash3"),
    (lambda: Policy.preset("fa2"), ValueError, "fa2.*format"),
    (lambda: as_policy("fa3:bf16"), ValueError, "fa3"),
    (lambda: as_policy("fa2"), ValueError, "fa2"),
    (lambda: as_policy("fa2:bf17"), ValueError, "bf17"),
    (lambda: as_policy(3), TypeError, "policy"),
    (lambda: as_policy(None), TypeError, "policy"),
])
def test_preset_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("field, value, exc", [
    ("rounding", "nearest_odd", ValueError),
    ("rounding", None, ValueError),
    ("seed", -1, ValueError),
    ("seed", 2**64, ValueError),
    ("seed", 1.5, ValueError),
    ("seed", True, ValueError),
    ("block_q", 0, ValueError),
    ("block_q", 2.0, ValueError),
    ("block_kv", -3, ValueError),
    ("block_kv", True, ValueError),
    ("loop_order", "kv_inner", ValueError),
    ("normalize", "lazy", ValueError),
    ("exp", "exp10", ValueError),
    ("p", "fp12", ValueError),
    ("score", 16, TypeError),
    ("state", "bf17", ValueError),
])
def test_bad_field_names_the_parameter(field, value, exc):
    with pytest.raises(exc, match=field):
        Policy.fa2("bf16").replace(**{field: value})


def test_policy_fields_are_keyword_only():
    stages = {s: "fp32" for s in STAGES if s != "state"}
    assert Policy(**stages, state=None).stages()["p"] == "fp32"
    with pytest.raises(TypeError, match="positional"):
        Policy(*["fp32"] * 12)


def test_policy_text_parsed_once_and_errors_each_time():
    """A policy string's Policy is built once (host time per call) and equals the preset; a bad string raises every
    time, naming the argument it was passed as."""
    a, b = as_policy("fa2:bf16"), as_policy(" fa2 ( bf16 ) ")
    assert a is as_policy("fa2:bf16") and a == Policy.fa2("bf16") and b == a
    assert a._c is as_policy("fa2:bf16")._c  # the C tuple too
    for _ in range(2):
        with pytest.raises(ValueError, match="reference 'fa2:nope'"):
            as_policy("fa2:nope", "reference")
        with pytest.raises(ValueError, match="malformed"):
            as_policy("fa2::bf16")
