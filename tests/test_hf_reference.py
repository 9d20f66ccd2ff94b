"""fadev.hf.reference_model: the recipe for comparing a "fadev" model against transformers' own attention, and the
warning where the shared-config trap shows (a use block in which no fadev attention ran).

transformers writes attn_implementation into the config object: a reference built from the fadev model's config
turns the fadev model into sdpa, and the comparison reads 0. The tests show the trap (skipped where transformers
no longer falls into it), that the recipe keeps the fadev model fadev (its logits differ from the reference's
under fa2:bf16 and equal them under sdpa), and that the warning fires in the trap and not in the recipe."""
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import fadev.hf as hf  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


def _config():
    return LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def _fadev_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(), attn_implementation="fadev", dtype=torch.float32).eval()


IDS = torch.arange(1, 17).reshape(1, 16)


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_reference_model_keeps_the_fadev_model_fadev():
    model = _fadev_model()
    ref = hf.reference_model(model)
    assert model.config._attn_implementation == "fadev" and ref.config._attn_implementation == "sdpa"
    assert ref.config is not model.config and all(m.config is ref.config for m in ref.modules() if hasattr(m, "config"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnusedBlockWarning)
        with hf.use("fa2:bf16"):
            low = _logits(model)
        with hf.use(kernel="sdpa"):
            same = _logits(model)
    plain = _logits(ref)
    assert (low - plain).abs().max() > 1e-4  # fadev's bf16 flash: a real difference from sdpa
    assert torch.equal(same, plain)  # same weights: the twin is the same model on sdpa


def test_the_shared_config_trap_is_seen():
    """The trap itself: a reference from the same config switches the fadev model to sdpa, the comparison
    reads 0, and the use block that ran no fadev attention warns with the recipe."""
    model = _fadev_model()
    trap = AutoModelForCausalLM.from_config(model.config, attn_implementation="sdpa", dtype=torch.float32).eval()
    trap.load_state_dict(model.state_dict())
    if model.config._attn_implementation == "fadev":
        pytest.skip("this transformers no longer writes attn_implementation into a shared config")
    with pytest.warns(hf.UnusedBlockWarning, match="reference_model"):
        with hf.use("fa2:bf16"):
            low = _logits(model)
    assert torch.equal(low, _logits(trap))  # the comparison that reads 0.0


def test_warning_only_where_no_fadev_attention_ran():
    model = _fadev_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", hf.UnusedBlockWarning)
        with hf.use(kernel="sdpa"):  # sdpa: nothing of fadev's to miss
            pass
        with hf.use("golden"), hf.use("fa2:bf16"):  # the outer block counts the inner block's calls
            _logits(model)
        with pytest.raises(RuntimeError, match="boom"), hf.use("golden"):  # an exception: no warning on top
            raise RuntimeError("boom")
    with pytest.warns(hf.UnusedBlockWarning):
        with hf.use("golden"):
            pass


def test_reference_model_refuses_what_is_not_a_model():
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel"):
        hf.reference_model(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="attn_implementation"):
        hf.reference_model(_fadev_model(), attn_implementation="")
