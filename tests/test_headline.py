"""The report's headline (fadev/experiments/headline.py): every number in it comes from the data, each sentence
only where its experiment ran, and its words follow the data (the real policy "more" or "less" accurate)."""
import pandas as pd

from fadev import report
from fadev.experiments.headline import headline


def _results(fa2=3e-5, naive=6e-5, ratio=13.4, share=0.89):
    precision = pd.DataFrame({"format": ["bf16"], "N": [16384], "block_q": [64], "block_kv": [64],
                              "ratio.rmse.mean": [ratio], "ratio.rmse.count": [3]})
    attribution = pd.DataFrame({"format": "bf16", "direction": "raise", "stage": ["none", "stats", "out_acc"],
                                "flash_vs_golden.rmse.mean": [8e-4, 8e-4 * (1 - share) ** 0.5, 7e-4],
                                "share": [float("nan"), share, 0.11]})
    kernels = pd.DataFrame({"impl": ["emulated fa2", "emulated naive", "emulated fa2", "emulated naive"],
                            "format": "bf16", "N": [1024, 1024, 16384, 16384],
                            "vs_golden.rmse.mean": [1e-4, 1e-4, fa2, naive]})
    fp8 = pd.DataFrame({"variant": ["baseline fp16", "FA2 fp16"], "vs_golden.rmse.mean": [2.5e-4, 4e-5]})
    seqlen = pd.DataFrame({"format": "bf16", "N": [128, 4096, 32768], "ratio.rmse.mean": [1.26, 3.0, 58.4]})
    return {name: {"df": df} for name, df in (("precision", precision), ("attribution", attribution),
                                              ("kernels", kernels), ("fp8", fp8), ("seqlen", seqlen))}


def test_headline_numbers_come_from_the_data():
    [text] = headline(_results())
    assert text.startswith("**In short.** ") and text.count(". ") + 1 in range(3, 7)
    assert "deviates 13.4x as much as the baseline" in text and "mean over 3 seeds of each seed's ratio" in text
    assert "softmax statistics" in text and "removes 89% of paper(bf16)'s squared error" in text
    assert "is 2x more accurate than the baseline at N = 16384 (RMSE 3.00e-05 vs 6.00e-05)" in text
    assert "the baseline's RMSE is 6.25x FA2's at fp16" in text and "58.4x at N = 32768" in text
    [other] = headline(_results(fa2=9e-5, ratio=3.1, share=0.5))
    assert "deviates 3.1x" in other and "is 1.5x less accurate than the baseline" in other and "removes 50%" in other


def test_headline_only_from_what_ran(tmp_path):
    results = _results()
    assert headline({"fp8": results["fp8"]}) == [
        "**In short.** FlashAttention-3's \"FA2/FA3 more accurate than the baseline\" compares that real policy, not "
        "paper(F), with the baseline: the baseline's RMSE is 6.25x FA2's at fp16."]
    assert headline({}) == [] and headline({"ring": {"df": pd.DataFrame({"W": [1]})}}) == []
    path = report.write(str(tmp_path / "r.md"), {}, title="T", command="c", headline=["HEAD"])
    text = open(path).read()
    assert text.index("HEAD") < text.index("sizes, ran on") and text.startswith("# T\n\nHEAD\n")
