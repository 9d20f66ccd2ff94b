"""Build fadev._core: the C core (csrc/*.c) and, where they can run, the CUDA kernels (cuda/*.cu).

The CUDA kernels are built by default only where nvcc is found AND a CUDA device is visible
(:func:`cuda_device_visible`); a machine with the toolkit but no GPU (a CI runner, a laptop) gets the C core
alone, in seconds instead of minutes. One line on stderr says what is built and why (`pip install -v` shows it).

Environment:
  FADEV_CUDA=0      build without CUDA even where nvcc and a GPU are found
  FADEV_CUDA=1      build the CUDA kernels whether or not a GPU is visible (error if nvcc is missing)
  CUDA_HOME         CUDA toolkit root (else nvcc is looked up on PATH)
  FADEV_CFLAGS      extra C compiler flags (e.g. the sanitizer flags used by .ci/run)
  FADEV_NVCC_FLAGS  extra nvcc flags (e.g. -DGOLDEN_BLOCK_N_64=32 to try another golden tile)
  FADEV_LDFLAGS     extra linker flags
  FADEV_CUDA_ARCH   space-separated SM numbers (default "80 90")
  FADEV_BUILD_JOBS  nvcc processes run side by side (default: the CPU count)

Like cupy's build_ext: .cu files are compiled to objects by nvcc and handed to the linker as extra
objects; the CUDA runtime is linked statically so `import fadev` never needs libcudart. Each object is
kept in build/fadev-cuda-objects/ under the hash of what made it (its source, the headers it includes, the
nvcc command and version), so a rebuild (another `pip install -e .` included) compiles only what changed.
The build's configuration (CUDA or not, flags) is recorded in the build directory per output file: when it
differs from the last build's, the extension is rebuilt and relinked, so a build never packages a `_core`
made under another configuration.
"""
import concurrent.futures
import glob
import hashlib
import json
import os
import re
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


def cuda_device_visible(dev="/dev", smi="nvidia-smi"):
    """Where a CUDA device is seen, as text ("/dev/nvidia0", "nvidia-smi -L: GPU 0: ..."), or None.

    Two probes, neither of which needs the CUDA runtime (a build cannot load one before it is built): the
    driver's device nodes /dev/nvidia0, /dev/nvidia1, ... (every Linux host and container given a GPU has
    them, even without nvidia-smi), then `nvidia-smi -L` listing a GPU (WSL2 and other setups without those
    nodes). /dev/nvidiactl or /dev/nvidia-uvm alone do not count: a driver can be loaded with no GPU."""
    nodes = sorted(p for p in glob.glob(os.path.join(dev, "nvidia*")) if re.fullmatch(r"nvidia\d+", os.path.basename(p)))
    if nodes:
        return nodes[0]
    exe = shutil.which(smi)
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
    return f"nvidia-smi -L: {gpus[0].split(' (UUID')[0]}" if out.returncode == 0 and gpus else None


def cuda_decision(flag, nvcc, device):
    """(build CUDA?, why) from FADEV_CUDA's value ``flag`` ('', '0' or '1'), nvcc's path (or None) and
    :func:`cuda_device_visible`'s answer. SystemExit for FADEV_CUDA=1 without nvcc or another value."""
    flag = (flag or "").strip()
    if flag not in ("", "0", "1"):
        sys.exit(f"FADEV_CUDA must be 0, 1 or unset, got {flag!r}")
    if flag == "0":
        return False, "FADEV_CUDA=0"
    if flag == "1":
        if nvcc is None:
            sys.exit("FADEV_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        return True, f"FADEV_CUDA=1, nvcc {nvcc}" + ("" if device else ", no GPU visible: compiled, not runnable here")
    if nvcc is None:
        return False, "nvcc not found; FADEV_CUDA=1 with CUDA_HOME set builds the kernels"
    if device is None:
        return False, (f"nvcc found ({nvcc}) but no CUDA device visible (no /dev/nvidiaN, nvidia-smi -L lists no "
                       "GPU); FADEV_CUDA=1 builds the kernels anyway")
    return True, f"nvcc {nvcc}, CUDA device {device}; FADEV_CUDA=0 skips them"


INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def included_headers(src):
    """Every file that ``src`` includes with #include "...", transitively, resolved next to the including
    file (sorted absolute paths; system <...> headers are covered by the compiler's version instead)."""
    seen, todo = set(), [os.path.abspath(src)]
    while todo:
        path = todo.pop()
        with open(path, encoding="utf-8", errors="replace") as fh:
            names = INCLUDE.findall(fh.read())
        for name in names:
            dep = os.path.normpath(os.path.join(os.path.dirname(path), name))
            if os.path.exists(dep) and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return sorted(seen)


def object_key(cmd, src, compiler_version):
    """The hash of what makes an object: the compile command (paths relative to nothing: the object's own
    path left out), the compiler's version text, the source and every header it includes."""
    h = hashlib.sha256()
    h.update(json.dumps([cmd, compiler_version]).encode())
    for path in [os.path.abspath(src)] + included_headers(src):
        with open(path, "rb") as fh:
            h.update(os.path.basename(path).encode() + b"\0" + hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def compile_cached(jobs, cache_dir, compiler_version, workers, log=print):
    """Compile ``jobs`` ([(src, cmd)]; cmd without the output, which is appended as `-o OBJECT`) side by side on
    ``workers`` threads into ``cache_dir``, each object named by the hash of what makes it (:func:`object_key`):
    SRC.HASH.o. An object already there is reused, so a rebuild compiles only what changed and configurations
    that alternate (other flags, other archs) keep their objects. Written under a temporary name and renamed
    once complete: a failed or killed compile leaves no object. Returns (objects, the sources compiled);
    SystemExit naming the sources that failed."""
    os.makedirs(cache_dir, exist_ok=True)
    planned = []
    for src, cmd in jobs:
        key = object_key(cmd, src, compiler_version)
        planned.append((src, cmd, os.path.join(cache_dir, f"{os.path.basename(src)}.{key[:20]}.o")))
    todo = [job for job in planned if not os.path.exists(job[2])]

    def one(job):
        src, cmd, obj = job
        tmp = f"{obj}.{os.getpid()}.tmp"
        log(" ".join(cmd + ["-o", obj]))
        rc = subprocess.call(cmd + ["-o", tmp])
        if rc == 0:
            os.replace(tmp, obj)
        elif os.path.exists(tmp):
            os.remove(tmp)
        return rc

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        failed = [job[0] for job, rc in zip(todo, pool.map(one, todo)) if rc != 0]
    if failed:
        sys.exit("nvcc failed on " + ", ".join(os.path.basename(s) for s in failed))
    return [obj for _, _, obj in planned], [job[0] for job in todo]


def build_jobs():
    """FADEV_BUILD_JOBS (a positive integer), else the CPU count."""
    text = os.environ.get("FADEV_BUILD_JOBS", "").strip()
    if not text:
        return os.cpu_count() or 1
    if not text.isdigit() or int(text) < 1:
        sys.exit(f"FADEV_BUILD_JOBS must be a positive integer, got {text!r}")
    return int(text)


def config_changed(build_temp, output, config):
    """Whether ``config`` differs from the one the last build of ``output`` (an extension's file) recorded in
    build_temp: None where none is recorded (a first build of it here), else True or False; records ``config``
    for the next. Kept per output, since an in-place build and a wheel's build share build_temp."""
    path = os.path.join(build_temp, "fadev-build-config.json")
    try:
        with open(path) as fh:
            records = json.load(fh)
    except (OSError, ValueError):
        records = {}
    old = records.get(os.path.abspath(output))
    records[os.path.abspath(output)] = config
    os.makedirs(build_temp, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(records, fh, indent=1, sort_keys=True)
    return None if old is None else old != config


def touch_if_other_objects(build_temp, output, objects):
    """Marks ``objects`` newer than ``output`` when they are others than the last link of it used (config_changed's
    record): a source changed back to a version whose object is cached gives an object older than the module, and
    setuptools relinks only for a dependency newer than its output. Returns whether it touched them."""
    if not config_changed(build_temp, output + ":objects", sorted(os.path.basename(o) for o in objects)):
        return False
    for obj in objects:
        os.utime(obj)
    return True


class BuildExt(build_ext):
    """Compiles cuda/*.cu with nvcc into objects linked into fadev._core, when :func:`cuda_decision` says so."""

    def build_extensions(self):
        nvcc, home = find_nvcc()
        flag = os.environ.get("FADEV_CUDA", "")
        device = None if flag.strip() in ("0", "1") or nvcc is None else cuda_device_visible()
        with_cuda, why = cuda_decision(flag, nvcc, device)
        print(f"fadev: building the C core {'and the CUDA kernels' if with_cuda else 'only (no CUDA kernels)'}: {why}",
              file=sys.stderr, flush=True)
        config = {"cuda": with_cuda, "nvcc": nvcc if with_cuda else None, "cflags": extra_compile,
                  "ldflags": extra_link, "arch": os.environ.get("FADEV_CUDA_ARCH", "80 90") if with_cuda else None,
                  "nvcc_flags": os.environ.get("FADEV_NVCC_FLAGS", "") if with_cuda else None}
        for ext in self.extensions:
            changed = config_changed(self.build_temp, self.get_ext_fullpath(ext.name), config)
            if changed is not False and not self.force:  # a first build here may find a _core of unknown making
                if changed:
                    print("fadev: the build configuration changed since the last build here: rebuilding _core",
                          file=sys.stderr, flush=True)
                self.force = True
        for ext in self.extensions:
            if with_cuda:
                objects = self.compile_cuda(nvcc)
                ext.define_macros.append(("FADEV_WITH_CUDA", "1"))
                ext.extra_objects.extend(objects)
                ext.depends.extend(objects)  # relink when an object was compiled again
                touch_if_other_objects(self.build_temp, self.get_ext_fullpath(ext.name), objects)
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

        # the objects live in the source tree's build/ (not build_temp, which pip's editable installs put in a
        # temporary directory): every install from this tree reuses them
        cache_dir = os.path.join(ROOT, "build", "fadev-cuda-objects")
        jobs = [(src, [nvcc, "-c", src, "-O3", "-std=c++17", "--fmad=false", "-Xcompiler", "-fPIC",
                       "-Xcompiler", "-ffp-contract=off", "-Xcompiler", "-fvisibility=hidden", "-cudart", "static",
                       *gencode(src), *os.environ.get("FADEV_NVCC_FLAGS", "").split()])
                for src in sorted(glob.glob(os.path.join(ROOT, "cuda", "*.cu")))]
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        workers = build_jobs()
        objects, compiled = compile_cached(jobs, cache_dir, version, workers)
        print(f"fadev: nvcc compiled {len(compiled)} of {len(jobs)} CUDA files ({workers} at a time; "
              f"{len(jobs) - len(compiled)} unchanged, reused from {cache_dir})", file=sys.stderr, flush=True)
        return objects


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

if __name__ == "__main__":  # setuptools runs this file as __main__; tests/test_setup.py imports its helpers
    setup(ext_modules=[core], cmdclass={"build_ext": BuildExt})
