"""Build fadev._core: the C core (csrc/*.c) and, when nvcc is available, the CUDA kernels (cuda/*.cu).

Environment:
  FADEV_CUDA=0      build without CUDA even if nvcc is found
  FADEV_CUDA=1      require nvcc (error if it is missing)
  CUDA_HOME         CUDA toolkit root (else nvcc is looked up on PATH)
  FADEV_CFLAGS      extra C compiler flags (e.g. the sanitizer flags used by .ci/run)
  FADEV_NVCC_FLAGS  extra nvcc flags (e.g. -DGOLDEN_BLOCK_N_64=64 to try another golden tile)
  FADEV_LDFLAGS     extra linker flags
  FADEV_CUDA_ARCH   space-separated SM numbers (default "80 90")

Like cupy's build_ext: .cu files are compiled to objects by nvcc and handed to the linker as extra
objects; the CUDA runtime is linked statically so `import fadev` never needs libcudart.
"""
import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


CUDA_LIB_DIRS = ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"),
                 os.path.join("targets", "sbsa-linux", "lib"))


def nvcc_top(nvcc):
    """The toolkit root nvcc itself reports (`#$ TOP=...` of a dry run); nvcc may be a wrapper script."""
    try:
        out = subprocess.run([nvcc, "-dryrun", "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if line.startswith("#$ TOP="):
            return os.path.normpath(line.split("=", 1)[1].strip())
    return None


def find_nvcc():
    """(nvcc, toolkit root holding libcudart_static.a), or (None, None)."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc"), home
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None, None
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), nvcc_top(nvcc), "/usr/local/cuda"]
    for root in candidates:
        if root and any(os.path.exists(os.path.join(root, d, "libcudart_static.a")) for d in CUDA_LIB_DIRS):
            return nvcc, root
    return nvcc, candidates[0]


def cuda_wanted():
    flag = os.environ.get("FADEV_CUDA", "").strip()
    nvcc, home = find_nvcc()
    if flag == "0":
        return None, None
    if flag == "1" and nvcc is None:
        sys.exit("FADEV_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    return nvcc, home


class BuildExt(build_ext):
    """Compiles cuda/*.cu with nvcc into objects linked into fadev._core."""

    def build_extensions(self):
        nvcc, home = cuda_wanted()
        for ext in self.extensions:
            if nvcc:
                ext.define_macros.append(("FADEV_WITH_CUDA", "1"))
                ext.extra_objects.extend(self.compile_cuda(nvcc))
                ext.depends.extend(glob.glob(os.path.join(ROOT, "cuda", "*.cu*")))  # relink when a kernel changes
                libdirs = [os.path.join(home, d) for d in CUDA_LIB_DIRS]
                ext.library_dirs.extend(d for d in libdirs if os.path.isdir(d))
                ext.libraries.extend(["cudart_static", "rt", "dl"])
                # keep the CUDA runtime's and the C++ templates' symbols (CUB, libcu++) inside this module:
                # exported, they can bind to another extension's copies (GNU unique symbols are global)
                ext.extra_link_args += ["-lstdc++", "-Wl,--exclude-libs,ALL"]
        super().build_extensions()

    def compile_cuda(self, nvcc):
        archs = os.environ.get("FADEV_CUDA_ARCH", "80 90").split()

        def gencode(src):
            # Hopper's warpgroup MMA (cuda/*_wgmma.cu) exists only in the arch-specific sm_90a target: those files
            # build their Hopper code as 90a (their other targets compile the kernels to a trap, never launched)
            hopper_a = src.endswith("_wgmma.cu")
            flags = []
            for a in archs:
                a = a + "a" if hopper_a and a == "90" else a
                flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
            return flags

        build_dir = os.path.join(self.build_temp, "cuda")
        os.makedirs(build_dir, exist_ok=True)
        commands = []
        for src in sorted(glob.glob(os.path.join(ROOT, "cuda", "*.cu"))):
            obj = os.path.join(build_dir, os.path.basename(src) + ".o")
            commands.append([nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17", "--fmad=false", "-Xcompiler", "-fPIC",
                             "-Xcompiler", "-ffp-contract=off", "-Xcompiler", "-fvisibility=hidden",
                             "-cudart", "static", *gencode(src), *os.environ.get("FADEV_NVCC_FLAGS", "").split()])
        for cmd in commands:
            print(" ".join(cmd))
        # nvcc is slow per file and runs one process per file: compile them side by side
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            failed = [cmd for cmd, rc in zip(commands, pool.map(subprocess.call, commands)) if rc != 0]
        if failed:
            sys.exit("nvcc failed on " + ", ".join(os.path.basename(cmd[2]) for cmd in failed))
        return [cmd[4] for cmd in commands]


extra_compile = ["-std=c11", "-O3", "-Wall", "-Wextra", "-ffp-contract=off", "-fno-math-errno",
                 "-pthread"] + os.environ.get("FADEV_CFLAGS", "").split()
extra_link = ["-pthread", "-lm"] + os.environ.get("FADEV_LDFLAGS", "").split()

core = Extension(
    "fadev._core",
    sources=sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "*.c"))),
    include_dirs=[numpy.get_include(), "csrc"],
    depends=glob.glob(os.path.join(ROOT, "csrc", "*.h")),
    extra_compile_args=extra_compile,
    extra_link_args=extra_link,
)

setup(ext_modules=[core], cmdclass={"build_ext": BuildExt})
