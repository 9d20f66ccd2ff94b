"""setup.py's build decisions: CUDA only where a device is visible (FADEV_CUDA forces either way), the CUDA
objects cached by the hash of what made them, and a change of configuration forcing _core to be rebuilt."""
import os
import runpy
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="fadev_setup")  # its setup() runs as __main__ only


def test_cuda_decision():
    decide = SETUP["cuda_decision"]
    assert decide("", "/bin/nvcc", "/dev/nvidia0") == (True, "nvcc /bin/nvcc, CUDA device /dev/nvidia0; FADEV_CUDA=0 "
                                                              "skips them")
    build, why = decide("", "/bin/nvcc", None)
    assert not build and "no CUDA device visible" in why and "FADEV_CUDA=1" in why
    assert decide("", None, "/dev/nvidia0")[0] is False
    assert decide("0", "/bin/nvcc", "/dev/nvidia0") == (False, "FADEV_CUDA=0")
    build, why = decide("1", "/bin/nvcc", None)
    assert build and "no GPU visible" in why
    with pytest.raises(SystemExit, match="nvcc was not found"):
        decide("1", None, None)
    with pytest.raises(SystemExit, match="FADEV_CUDA must be 0, 1 or unset"):
        decide("yes", "/bin/nvcc", None)


def test_device_probe(tmp_path, monkeypatch):
    probe = SETUP["cuda_device_visible"]
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").write_text("")  # a loaded driver without a GPU: no device
    (dev / "nvidia-uvm").write_text("")
    assert probe(str(dev), smi="fadev-no-such-smi") is None
    (dev / "nvidia1").write_text("")
    assert probe(str(dev), smi="fadev-no-such-smi") == str(dev / "nvidia1")
    # no device nodes, but nvidia-smi lists a GPU (WSL2): found; one that fails or lists none: not
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "fake-smi"
    monkeypatch.setenv("PATH", str(bin_dir) + os.pathsep + os.environ["PATH"])
    empty = tmp_path / "empty"
    empty.mkdir()
    for body, found in (("echo 'GPU 0: NVIDIA H100 (UUID: GPU-1)'", "nvidia-smi -L: GPU 0: NVIDIA H100"),
                        ("echo 'No devices found'; exit 6", None), ("exit 0", None)):
        smi.write_text("#!/bin/sh\n" + body + "\n")
        smi.chmod(0o755)
        assert probe(str(empty), smi="fake-smi") == found, body


def test_included_headers_are_followed():
    deps = [os.path.relpath(p, ROOT) for p in SETUP["included_headers"](os.path.join(ROOT, "cuda", "emu_forward.cu"))]
    assert {"cuda/emu.cuh", "cuda/common.cuh", "csrc/fadev.h", "csrc/attention.h"} <= set(deps), deps


FAKE_NVCC = """import shutil, sys
args = sys.argv[1:]
src, obj = args[args.index("-c") + 1], args[args.index("-o") + 1]
open(sys.argv[0] + ".log", "a").write(src + "\\n")
if "BROKEN" in open(src).read():
    open(obj, "w").write("half an object")  # a failed compile may leave a partial output behind
    sys.exit(1)
shutil.copy(src, obj)
"""


def test_objects_are_cached_by_source_headers_and_flags(tmp_path):
    compile_cached = SETUP["compile_cached"]
    nvcc = tmp_path / "nvcc.py"
    nvcc.write_text(FAKE_NVCC)
    (tmp_path / "a.cuh").write_text("// a\n")
    (tmp_path / "one.cu").write_text('#include "a.cuh"\n')
    (tmp_path / "two.cu").write_text("// no include\n")
    cache = tmp_path / "cache"

    def build(flags=(), version="nvcc 13"):
        jobs = [(str(tmp_path / s), [sys.executable, str(nvcc), "-c", str(tmp_path / s), *flags])
                for s in ("one.cu", "two.cu")]
        objects, compiled = compile_cached(jobs, str(cache), version, workers=2, log=lambda line: None)
        assert [os.path.basename(o).split(".")[0] for o in objects] == ["one", "two"]
        assert all(os.path.exists(o) for o in objects)
        return sorted(os.path.basename(s) for s in compiled)

    assert build() == ["one.cu", "two.cu"]
    assert build() == []  # nothing changed: nothing compiled
    (tmp_path / "a.cuh").write_text("// a, changed\n")
    assert build() == ["one.cu"]  # only the file that includes the header
    assert build(flags=("-DX=1",)) == ["one.cu", "two.cu"]
    assert build(flags=("-DX=1",), version="nvcc 13.1") == ["one.cu", "two.cu"]
    assert build() == []  # the first configuration's objects are still there
    (tmp_path / "two.cu").write_text("BROKEN\n")
    with pytest.raises(SystemExit, match="nvcc failed on two.cu"):
        build()
    assert not [p for p in os.listdir(cache) if p.endswith(".tmp")]  # a failed compile leaves no object
    with pytest.raises(SystemExit, match="nvcc failed on two.cu"):
        build()  # and is tried again
    (tmp_path / "two.cu").write_text("// fixed\n")
    assert build() == ["two.cu"]


def test_config_record(tmp_path):
    changed = SETUP["config_changed"]
    temp, so, other = str(tmp_path / "b"), str(tmp_path / "x.so"), str(tmp_path / "y.so")
    assert changed(temp, so, {"cuda": False}) is None
    assert changed(temp, so, {"cuda": False}) is False
    assert changed(temp, other, {"cuda": True}) is None  # per output: an in-place build and a wheel's
    assert changed(temp, so, {"cuda": False}) is False
    assert changed(temp, so, {"cuda": True}) is True
    assert changed(temp, so, {"cuda": True}) is False


def test_other_objects_relink(tmp_path):
    """Switching a CUDA source back to a version whose object is cached reuses that object, which is older than the
    module: the objects of the last link are recorded, and other ones are touched so that setuptools relinks (a GPU
    run of an A/B found the module still holding the other version's kernels)."""
    touch = SETUP["touch_if_other_objects"]
    temp, so = str(tmp_path / "b"), str(tmp_path / "_core.so")
    a, b = tmp_path / "k.cu.aaaa.o", tmp_path / "k.cu.bbbb.o"
    for obj in (a, b):
        obj.write_text("")
        os.utime(obj, (1_000_000, 1_000_000))
    assert touch(temp, so, [str(a)]) is False  # the first record: the module is linked anyway
    assert touch(temp, so, [str(a)]) is False and a.stat().st_mtime == 1_000_000  # the same objects: nothing
    assert touch(temp, so, [str(b)]) is True and b.stat().st_mtime > 1_000_000  # B replaces A: relink
    os.utime(a, (1_000_000, 1_000_000))
    assert touch(temp, so, [str(a)]) is True and a.stat().st_mtime > 1_000_000  # back to the cached A: relink


def _build(tree, **env):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("FADEV_") and k != "LD_PRELOAD"}, **env}
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stderr


@pytest.mark.slow
def test_a_changed_configuration_rebuilds_core(tmp_path):
    """A build under another configuration (here FADEV_CFLAGS; FADEV_CUDA=0 then 1 the same way) relinks _core
    instead of keeping the last one: the step that packaged a CPU-only _core into a CUDA wheel."""
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("setup.py", "csrc"):
        (shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy)(os.path.join(ROOT, name),
                                                                                     tree / name)
    (tree / "fadev").mkdir()
    err = _build(tree, FADEV_CUDA="0")
    assert "fadev: building the C core only (no CUDA kernels): FADEV_CUDA=0" in err
    so = next(p for p in (tree / "fadev").iterdir() if p.name.startswith("_core"))
    first = so.stat().st_mtime_ns
    time.sleep(0.05)
    assert "rebuilding" not in _build(tree, FADEV_CUDA="0") and so.stat().st_mtime_ns == first  # up to date
    err = _build(tree, FADEV_CUDA="0", FADEV_CFLAGS="-DFADEV_TEST_CONFIG=1")
    assert "the build configuration changed since the last build here: rebuilding _core" in err
    assert so.stat().st_mtime_ns > first
