"""The package as built and installed: public names, version, worker threads, the command line, and
the C sources compiling warning-free under the project's flags."""
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import numpy as np
import pytest

import fadev
from fadev.__main__ import main
from helpers import find_cycle

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FADEV_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(fadev.__file__)))


def run_python(args, env=None, **kw):
    """Run `python args` outside the checkout (so the installed or in-place fadev is the one imported)."""
    full_env = dict(os.environ, PYTHONPATH=FADEV_PARENT, **(env or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env, timeout=120, **kw)


def test_public_names_and_version():
    for name in fadev.__all__:
        assert hasattr(fadev, name), name
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["version"] == fadev.__version__
    assert fadev._core.__doc__.startswith("fadev's C core")


def test_num_threads():
    fadev.set_num_threads(3)
    assert fadev.get_num_threads() == 3
    for bad in (0, 257, -1):
        with pytest.raises(ValueError, match=f"n must be between 1 and 256, got {bad}"):
            fadev.set_num_threads(bad)
    for bad in (1.5, True, "2"):
        with pytest.raises(TypeError, match="n must be an int"):
            fadev.set_num_threads(bad)
    assert fadev.get_num_threads() == 3


@pytest.mark.parametrize("value,expected", [("3", 3), ("1", 1), ("0", None), ("lots", None)])
def test_num_threads_environment(value, expected, tmp_path):
    r = run_python(["-c", "import fadev, os; print(fadev.get_num_threads(), os.cpu_count())"],
                   env={"FADEV_NUM_THREADS": value}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    threads, cpus = map(int, r.stdout.split())
    assert threads == (expected if expected is not None else cpus)  # invalid values fall back to the CPUs


def test_demo_in_process(capsys):
    assert main(["demo", "--n", "2000", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split() and line.split()[0] in fadev.formats}
    assert set(rows) == set(fadev.formats)
    assert [float(v) for v in rows["fp64"][4:9]] == [0.0] * 5  # fp64 rounds nothing
    for name in ("fp32", "bf16"):  # no subnormals or overflow in this sample: max_rel <= u = 2^-p
        assert 0 < float(rows[name][5]) <= fadev.formats[name].unit_roundoff
    assert int(rows["fp8_e4m3"][-1]) > 0 and int(rows["bf16"][-1]) == 0  # overflow counted: 448 < 2^12


def test_demo_modes_differ(capsys):
    main(["demo", "--n", "500", "--mode", "rtz"])
    rtz = capsys.readouterr().out
    main(["demo", "--n", "500", "--mode", "stochastic"])
    assert capsys.readouterr().out != rtz


def test_command_line(tmp_path):
    r = run_python(["-m", "fadev", "demo", "--n", "300"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "fp8_e5m2" in r.stdout and "wasserstein" in r.stdout
    r = run_python(["-m", "fadev"], cwd=tmp_path)
    assert r.returncode == 2 and "usage: fadev" in r.stderr
    r = run_python(["-m", "fadev", "demo", "--n", "0"], cwd=tmp_path)
    assert r.returncode == 2 and "--n: must be >= 1, got 0" in r.stderr
    r = run_python(["-m", "fadev", "--version"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"fadev {fadev.__version__}"


def test_c_sources_compile_warning_free(tmp_path):
    """Every csrc/*.c under the flags setup.py uses, warnings as errors (the shop's -Wall -Wextra rule)."""
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.c")))
    assert sources, "csrc/*.c not found next to tests/"
    includes = ["-I" + os.path.join(ROOT, "csrc"), "-I" + np.get_include(), "-I" + sysconfig.get_paths()["include"]]
    for src in sources:
        cmd = ["gcc", "-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off", "-fno-math-errno",
               "-pthread", "-fPIC", *includes, "-c", src, "-o", str(tmp_path / "x.o")]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{os.path.basename(src)}:\n{r.stderr}"


def native_sources():
    """Every C and CUDA source and header of csrc/ and cuda/, by path relative to the checkout."""
    paths = []
    for folder, pattern in (("csrc", "*.[ch]"), ("cuda", "*.cu"), ("cuda", "*.cuh")):
        paths += glob.glob(os.path.join(ROOT, folder, pattern))
    assert paths, "csrc/ and cuda/ not found next to tests/"
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def include_graph(sources):
    """file -> the files it names in a quoted #include (resolved against its own folder, as the compiler does)."""
    graph = {}
    for rel in sources:
        folder = os.path.dirname(rel)
        with open(os.path.join(ROOT, rel)) as f:
            quoted = [line.split('"')[1] for line in f if line.lstrip().startswith("#include \"")]
        graph[rel] = [os.path.normpath(os.path.join(folder, name)) for name in quoted]
    return graph


def test_find_cycle_finds_cycles():
    assert find_cycle({"a.h": ["b.h"], "b.h": ["c.h"], "c.h": ["a.h"]}) == ["a.h", "b.h", "c.h", "a.h"]
    assert find_cycle({"a.c": ["a.h", "b.h"], "a.h": ["b.h"], "b.h": []}) is None
    assert find_cycle({"x.h": ["x.h"]}) == ["x.h", "x.h"]


def test_no_include_cycle_in_the_c_and_cuda_sources():
    graph = include_graph(native_sources())
    assert graph["csrc/attention.h"] == ["csrc/matmul.h"]  # the layers: stage.h <- matmul.h <- attention.h
    assert "csrc/stage.h" in graph["csrc/matmul.h"]
    missing = {name for targets in graph.values() for name in targets} - set(graph)
    assert not missing, f"quoted #include of files that do not exist: {sorted(missing)}"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_c_and_cuda_sources_stay_small():
    lines = {}
    for rel in native_sources():
        with open(os.path.join(ROOT, rel)) as f:
            lines[rel] = sum(1 for _ in f)
    assert not {rel: n for rel, n in lines.items() if n >= 600}, "split these files (each < 600 lines)"


# ptxas's notes on Hopper's warpgroup MMA, codes C75xx, each a "Potential Performance Loss": C7514 (wgmma
# serialised because other instructions read its accumulators mid-flight: what the wgmma forward's overlap first
# compiled to), C7512 (serialised for registers: the 192-row tiles with Q in registers), C7517 (a warpgroup wait
# the compiler injected), C7518 (a wgmma in a path ptxas thinks divergent: the D 128 backward's first dQ^T loop).
# Only a GPU can time the kernels; these notes show without one.
WGMMA_NOTE = re.compile(r"\(C75\d\d\)")
NVCC = os.environ.get("CUDA_HOME") and os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
NVCC = NVCC if NVCC and os.path.exists(NVCC) else shutil.which("nvcc")


def wgmma_notes(src, tmp_path, *flags):
    """Compile src for sm_90a under setup.py's nvcc flags; ptxas's lines that carry a WGMMA_NOTE code."""
    out = tmp_path / (os.path.basename(src) + "".join(flags) + ".cubin")
    cmd = [NVCC, "-cubin", src, "-o", str(out), "-I" + os.path.join(ROOT, "cuda"), "-O3", "-std=c++17",
           "--fmad=false", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v", *flags]
    # the toolkit runs without the sanitizer runtime .ci/run preloads for fadev's C core
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"{os.path.basename(src)}:\n{r.stderr[-3000:]}"
    return [line for line in (r.stdout + r.stderr).splitlines() if WGMMA_NOTE.search(line)]


SERIALISED = r"""
#include "wgmma.cuh"
__global__ void serialised(float *out, uint64_t da, uint64_t db, int n) {
#if FADEV_WGMMA
    float d[32], e[32];
    for (int i = 0; i < 32; ++i) d[i] = e[i] = 0.f;
    for (int j = 0; j < n; ++j) {
        wgmma_fence();
        wgmma_ss<__nv_bfloat16, 64>(d, da + j, db, 1);
        wgmma_commit();
        for (int i = 0; i < 32; ++i) e[i] += d[i];  /* reads d while its wgmma may be in flight */
        wgmma_wait_all();
    }
    for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d[i] + e[i];
#endif
}
"""


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA_HOME or PATH)")
def test_wgmma_kernels_keep_their_overlap(tmp_path):
    """cuda/*_wgmma.cu compile with every wgmma asynchronous. The check catches a kernel that reads accumulators
    mid-flight (C7514), and the forward built with Q in registers on its 192-row tiles too (C7512)."""
    bad = tmp_path / "serialised.cu"
    bad.write_text(SERIALISED)
    sources = sorted(glob.glob(os.path.join(ROOT, "cuda", "*_wgmma.cu")))
    assert [os.path.basename(s) for s in sources] == ["native_backward_dq_tma_wgmma.cu", "native_backward_dq_wgmma.cu",
                                                      "native_backward_tma_wgmma.cu", "native_backward_wgmma.cu",
                                                      "native_forward_tma_wgmma.cu", "native_forward_wgmma.cu"]
    forward = os.path.join(ROOT, "cuda", "native_forward_wgmma.cu")
    jobs = {"bad": (str(bad),), "qreg": (forward, "-DFADEV_WGMMA_QREG=2"), **{s: (s,) for s in sources}}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        notes = dict(zip(jobs, pool.map(lambda job: wgmma_notes(job[0], tmp_path, *job[1:]), jobs.values())))
    assert any("(C7514)" in line for line in notes.pop("bad")), "ptxas no longer reports serialised wgmma"
    assert any("(C7512)" in line for line in notes.pop("qreg")), "the 192-row tiles with Q in registers fit now"
    assert notes == {src: [] for src in sources}, notes
