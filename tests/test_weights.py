"""fadev.weights.compare: per-tensor and model-level weight distances on known tensors, scipy parity of the
Wasserstein-1 column, inputs (modules, state dicts, NumPy, bfloat16), and every documented error."""
import math

import ml_dtypes
import numpy as np
import pytest
import scipy.stats
import torch

from fadev import weights


def _state(rng):
    return {"w": rng.standard_normal((7, 5)), "b": rng.standard_normal(5), "e": rng.standard_normal((3, 4, 2))}


def test_identical_is_zero(rng):
    a = _state(rng)
    df = weights.compare(a, {k: v.copy() for k, v in a.items()})
    assert list(df["name"]) == ["w", "b", "e", weights.MODEL_ROW]
    assert list(df.columns) == list(weights.COLUMNS)
    assert (df[["max_abs", "wasserstein", "rmse", "rel_l2"]].to_numpy() == 0).all()
    assert df["numel"].tolist() == [35, 5, 24, 64]


def test_known_shift(rng):
    """b = a + c exactly (c a power of two, values small enough that the addition is exact): every metric
    is known in closed form."""
    c = 0.25
    a = {k: np.ldexp(np.round(np.ldexp(v, 20)), -20) for k, v in _state(rng).items()}
    b = {k: v + c for k, v in a.items()}
    assert all(np.array_equal(b[k] - a[k], np.full(a[k].shape, c)) for k in a)
    df = weights.compare(b, a).set_index("name")
    assert (df["max_abs"] == c).all()
    assert (df["wasserstein"] == c).all()
    assert (df["rmse"] == c).all()
    for k in a:
        assert df.loc[k, "rel_l2"] == pytest.approx(c * math.sqrt(a[k].size) / np.linalg.norm(a[k]), rel=1e-14)
    total = math.sqrt(sum(np.sum(v * v) for v in a.values()))
    assert df.loc[weights.MODEL_ROW, "rel_l2"] == pytest.approx(c * 8 / total, rel=1e-14)  # sqrt(64) = 8


def test_wasserstein_matches_scipy_and_aggregates(rng):
    a, b = _state(rng), _state(rng)
    b["w"] = b["w"] * 3 + 1  # different distributions, different per-tensor distances
    df = weights.compare(a, b).set_index("name")
    for k in a:
        ref = scipy.stats.wasserstein_distance(a[k].ravel(), b[k].ravel())
        assert df.loc[k, "wasserstein"] == pytest.approx(ref, rel=1e-12)
        assert df.loc[k, "max_abs"] == np.max(np.abs(a[k] - b[k]))
        assert df.loc[k, "rmse"] == pytest.approx(np.sqrt(np.mean((a[k] - b[k]) ** 2)), rel=1e-13)
    per = df.drop(weights.MODEL_ROW)
    model = df.loc[weights.MODEL_ROW]
    flat_a = np.concatenate([a[k].ravel() for k in a])
    flat_b = np.concatenate([b[k].ravel() for k in a])
    assert model["max_abs"] == per["max_abs"].max() == np.max(np.abs(flat_a - flat_b))
    assert model["wasserstein"] == pytest.approx(np.dot(per["numel"], per["wasserstein"]) / 64, rel=1e-14)
    assert model["rmse"] == pytest.approx(np.sqrt(np.mean((flat_a - flat_b) ** 2)), rel=1e-13)
    assert model["rel_l2"] == pytest.approx(np.linalg.norm(flat_a - flat_b) / np.linalg.norm(flat_b), rel=1e-13)


def test_modules_tensors_and_attrs():
    torch.manual_seed(0)
    m1 = torch.nn.Linear(4, 3)
    m2 = torch.nn.Linear(4, 3)
    with torch.no_grad():
        m1.weight[1, 2] = 1.0
        m2.weight.copy_(m1.weight)
        m2.bias.copy_(m1.bias)
        m2.weight[1, 2] = 1.5
    df = weights.compare(m2, m1)
    assert df.attrs["max_abs_tensor"] == "weight"
    assert df.attrs["model"]["max_abs"] == df.iloc[-1]["max_abs"] == 0.5
    assert df.set_index("name").loc["bias", "max_abs"] == 0
    assert df.set_index("name").loc["weight", "wasserstein"] == pytest.approx(0.5 / 12, rel=1e-12)
    d = weights.model_distance(m2, m1)
    assert d["max_abs_tensor"] == "weight" and d["numel"] == 15


def test_bfloat16_tensor_and_ml_dtypes_array_are_exact(rng):
    x = rng.standard_normal(100).astype(np.float32)
    t = torch.from_numpy(x).bfloat16()
    arr = x.astype(ml_dtypes.bfloat16)
    ref = t.double().numpy()
    df = weights.compare({"x": t}, {"x": ref})
    assert df.loc[0, "max_abs"] == 0  # bfloat16 -> float64 with no rounding
    df = weights.compare({"x": arr}, {"x": t})
    assert df.loc[0, "max_abs"] == 0


def test_nan_propagates(rng):
    a = _state(rng)
    b = {k: v.copy() for k, v in a.items()}
    b["b"][2] = np.nan
    df = weights.compare(a, b).set_index("name")
    assert math.isnan(df.loc["b", "max_abs"]) and math.isnan(df.loc[weights.MODEL_ROW, "max_abs"])
    assert df.loc["w", "max_abs"] == 0


def test_empty_tensor_rows_are_zero(rng):
    df = weights.compare({"e": np.zeros((0, 3)), "x": np.ones(2)}, {"e": np.zeros((0, 3)), "x": np.ones(2)})
    assert df.loc[0, "numel"] == 0 and df.loc[0, "max_abs"] == 0 and df.iloc[-1]["numel"] == 2


def test_errors(rng):
    a = _state(rng)
    with pytest.raises(ValueError, match="only in a: 'e'"):
        weights.compare(a, {k: a[k] for k in ("w", "b")})
    with pytest.raises(ValueError, match="only in b: 'z'"):
        weights.compare(a, dict(a, z=np.ones(1)))
    with pytest.raises(ValueError, match=r"tensor 'b': a has shape \(5,\), b has shape \(6,\)"):
        weights.compare(a, dict(a, b=np.ones(6)))
    with pytest.raises(ValueError, match="hold no tensors"):
        weights.compare({}, {})
    with pytest.raises(TypeError, match="a: expected a torch.nn.Module or a mapping"):
        weights.compare([1, 2], a)
    with pytest.raises(TypeError, match=r"b\['w'\]: expected a real numeric"):
        weights.compare(a, dict(a, w=np.array(["x"] * 35).reshape(7, 5)))
    with pytest.raises(TypeError, match=r"a\['c'\]: complex tensors"):
        weights.compare({"c": torch.zeros(2, dtype=torch.complex64)}, {"c": torch.zeros(2, dtype=torch.complex64)})
