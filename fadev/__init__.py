"""fadev: numerical deviation of attention kernels.

Baseline and flash attention under a per-stage precision policy, low-precision formats bit-exact
against ml_dtypes, and deviation metrics against an fp64 golden answer. See README.md.

Submodules not imported here (``fadev.torch`` needs PyTorch; ``fadev.weights``, ``fadev.sweep``,
``fadev.experiments``, ...) are imported on first attribute access,
so ``import fadev`` never imports torch and ``fadev.torch.attention`` works without an explicit import.
"""
import importlib
import importlib.util

from . import _core
from .formats import (Format, as_format, custom_format, formats, from_bits, from_ml_dtypes, round, to_bits,
                      to_ml_dtypes, ulp)
from .formats import integer as _integer
from .metrics import (Comparison, UlpHistogram, compare, max_abs, max_rel, mean_abs, mean_diff, rel_l2, rmse,
                      std_diff, ulp_error, ulp_histogram, wasserstein)
from .policy import PRESETS, STAGES, Policy, as_policy
from .attention import baseline_attention, flash_attention, golden_attention, random_qkv
from .backward import baseline_attention_backward, flash_attention_backward
from .ring import RingMerge, ring_attention, ring_attention_backward, ring_coverage
from .cuda import DeviceArray
from .native import native_attention, native_attention_backward, native_tiles

__version__ = "0.1.0"


def __getattr__(name):
    """Import a submodule (``fadev.torch``, ``fadev.sweep``, ...) on first access (PEP 562)."""
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_num_threads() -> int:
    """Worker threads used by fadev's C kernels (results never depend on it)."""
    return _core.get_num_threads()


def set_num_threads(n: int) -> None:
    """Set the number of worker threads (1..256); FADEV_NUM_THREADS sets the default."""
    n = _integer(n, "n")
    if not 1 <= n <= 256:
        raise ValueError(f"n must be between 1 and 256, got {n}")
    _core.set_num_threads(n)


def cuda_available() -> bool:
    """True when fadev was built with CUDA and a CUDA device can run its kernels."""
    info = _core.cuda_info()
    return bool(info["compiled"] and info["devices"])


def cuda_info() -> dict:
    """{'compiled': bool, 'devices': [{'index', 'name', 'capability', 'total_memory'}, ...]}."""
    return _core.cuda_info()


__all__ = ["Format", "as_format", "custom_format", "formats", "round", "to_bits", "from_bits", "to_ml_dtypes",
           "from_ml_dtypes", "ulp", "get_num_threads", "set_num_threads", "cuda_available", "cuda_info"]
__all__ += ["Comparison", "compare", "max_abs", "mean_diff", "std_diff", "mean_abs", "rmse", "rel_l2", "max_rel",
            "wasserstein", "ulp_error", "ulp_histogram", "UlpHistogram"]
__all__ += ["Policy", "as_policy", "STAGES", "PRESETS", "baseline_attention", "flash_attention", "random_qkv"]
__all__ += ["baseline_attention_backward", "flash_attention_backward"]
__all__ += ["RingMerge", "ring_attention", "ring_attention_backward", "ring_coverage"]
__all__ += ["golden_attention", "DeviceArray", "native_attention", "native_attention_backward", "native_tiles"]
