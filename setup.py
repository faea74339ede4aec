"""Builds ppo_kernels._C (operator schemas, CUDA kernels when a matching toolkit exists,
build_info) and the CPU kernels once per SIMD capability (_cpu_default, _cpu_avx2,
_cpu_avx512); ppo_kernels/_extension.py loads the best one this processor runs, as ATen
does.

The extension is compiled against the torch of the environment that runs this file, so
install with `pip install --no-build-isolation .` (or `uv pip install --no-build-isolation
.`); an isolated build cannot see that torch and is stopped with an explanation. No
environment variable is needed; each choice below can be overridden:

- CUDA toolkit: CUDA_HOME (or CUDA_PATH) if set, else the toolkit that the `nvcc` on PATH
  belongs to (nvcc's own report of where it runs from, so a symlink or a wrapper script in
  /usr/local/bin is followed to the real toolkit), else /usr/local/cuda and
  /usr/local/cuda-<torch's CUDA version>. Its major version must be the installed torch's
  CUDA major version; when no such toolkit exists, or torch is a CPU-only build, the CPU
  kernels are built alone (the Triton backend still runs on GPUs) and
  `ppo_kernels.build_info()["cuda_skipped"]` says why. PPO_KERNELS_NO_CUDA=1 skips CUDA.
- PPO_KERNELS_CPU_CAPABILITIES: all (default: the CPU kernels once per SIMD capability,
  for any x86-64 CPU), native (this processor's alone) or a comma list.
- TORCH_CUDA_ARCH_LIST: with a visible GPU torch's own default (that GPU); without one
  DEFAULT_ARCHS, the architecture the CUDA kernels are written for, plus PTX.
- MAX_JOBS: the cores this process may use, at most one job per 2 GiB of available memory
  (one torch translation unit peaks near 1.6 GB). The extensions compile side by side (a
  ninja each, MAX_JOBS jobs each, as many at once as the memory allows at 2 GiB a job):
  one module's long file (a CUDA unit) no longer leaves a core idle while the others wait.

The CPU modules' files include the torch headers precompiled once per module
(csrc/cpu/torch_headers.h, GCC's precompiled headers; precompile_headers): about a third
less compile time for each CPU variant, and the same code.

The torch the build used (version, CUDA version, C++ ABI) and these choices are written to
ppo_kernels/_build_meta.py next to the compiled modules; the extension refuses to load
under another torch (an ImportError saying how to rebuild), and the wheel's metadata pins
that torch version.
"""

import glob
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.abspath(__file__))
# The oldest torch this source builds against and passes the tests with: CI builds it
# and runs a named subset of the tests (scripts/check_install.sh).
OLDEST_TORCH = (2, 6)
DEFAULT_ARCHS = "9.0+PTX"
GIB_PER_JOB = 2
# -g0: Python's own CFLAGS (sysconfig) carry -g, which costs a fifth of the host compile
# time and changes no instruction (GCC's -g never alters code generation: -fcompare-debug)
CXX_FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-Wall", "-Wno-unused-function", "-g0"]
# The CUDA sources compile as two translation units ("unity" builds): every .cu file parses
# the same torch headers in nvcc's device and host passes (~40 s a file on one core), while
# its own kernels take seconds. Each unit includes its files in this order; ninja tracks
# the included files through nvcc's depfile. The kernels' SASS for sm_90 is the same
# instruction for instruction as when each file compiles alone (checked with cuobjdump
# -sass). sampling.cu and distill.cu sit in different units: both define block_sum /
# block_max in their own anonymous namespace. A new .cu file goes into one of the lists
# (setup.py fails on a file in none).
CUDA_UNITS = (("ppo_loss", "logprobs", "distill", "gae"),
              ("sampling", "score_rollout", "scale_grad"))
# Flags ATen uses for its own per-capability kernels (cmake/Codegen.cmake).
SIMD = {
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2",
             "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}
INSTALL_HINT = """\
    pip install --no-build-isolation <this source: a checkout, a git+URL>
    uv pip install --no-build-isolation <the same>
    python -m build --wheel --no-isolation      (a wheel for this environment's torch)"""


def say(msg):
    # pip shows a build's output only when it fails or with -v; what a user must know
    # after a successful build is also in ppo_kernels.build_info()
    print(f"ppo_kernels setup: {msg}", file=sys.stderr, flush=True)


def progress(msg):
    """A build step for the person waiting: on stderr (pip shows it with -v), and, when pip
    captures stderr, on the terminal the install runs in (/dev/tty), so that a plain `pip
    install` says what it compiles and for how long instead of a bare spinner."""
    say(msg)
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(f"ppo_kernels setup: {msg}\n")
    except OSError:  # no terminal (CI, a batch job): stderr alone
        pass


# What each module holds, and what the whole build usually takes from scratch on 2 cores
# with the modules side by side (an Intel Xeon with AVX-512, torch 2.14.1, 2026-12-06: 204 s
# in CI with CUDA and three CPU variants, their torch headers precompiled; 275 s without)
WHAT = {"_C": "the operator schemas", "_C_cuda": "the operator schemas and the CUDA kernels",
        "_cpu": "the CPU kernels for {} processors"}
USUAL = ("from scratch on 2 cores about 3.5 min with the CUDA kernels and every CPU variant, "
         "about 1 min for this processor's CPU kernels alone")


def fail(msg):
    sys.exit(f"\nppo_kernels setup: error: {msg}\n")


def version_tuple(text):
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def isolated_markers(path):
    """The temporary environments of pip, pypa/build and uv isolated builds."""
    return any(m in path for m in ("pip-build-env-", os.sep + "build-env-", "builds-v0"))


def import_torch():
    try:
        import setuptools
    except ImportError:  # pragma: no cover (pip needs it to get here)
        fail("setuptools is not installed: pip install 'setuptools>=77'")
    if version_tuple(setuptools.__version__) < (77,):
        fail(f"setuptools {setuptools.__version__} is too old for pyproject.toml (SPDX "
             f"license): pip install -U 'setuptools>=77', then build again")
    try:
        import torch
    except ImportError:
        fail("torch is not importable in this build. ppo-kernels compiles C++ (and CUDA) "
             "against the torch of the environment it is installed into, and a build "
             "isolated from that environment (pip's and uv's default, `python -m build` "
             "without --no-isolation) cannot see it; a torch fetched into the isolated "
             "environment could be another version, whose compiled kernels would not load "
             "under yours. Install torch first if it is not there (`pip install torch`), "
             f"then build with:\n{INSTALL_HINT}")
    where = os.path.dirname(torch.__file__)
    if (isolated_markers(where) or isolated_markers(sys.prefix)) and \
            os.environ.get("PPO_KERNELS_ALLOW_ISOLATED_BUILD") != "1":
        fail(f"this is an isolated build (torch {torch.__version__} from {where}): the "
             f"extension would be compiled against that torch, not the one you run, and the "
             f"package would then require torch=={torch.__version__.split('+')[0]} (pip "
             f"would swap your torch for it). Build with:\n{INSTALL_HINT}\n"
             f"(PPO_KERNELS_ALLOW_ISOLATED_BUILD=1 builds anyway, e.g. when the build "
             f"environment's torch is pinned to the target's)")
    if version_tuple(torch.__version__)[:2] < OLDEST_TORCH:
        fail(f"torch {torch.__version__} is older than the oldest supported torch "
             f"{'.'.join(map(str, OLDEST_TORCH))}: pip install -U 'torch>="
             f"{'.'.join(map(str, OLDEST_TORCH))}'")
    return torch


def nvcc_version(nvcc):
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def nvcc_home(nvcc):
    """The toolkit an `nvcc` belongs to: nvcc's dry run reports the directory it really
    runs from (_HERE_), whatever symlink or wrapper script started it."""
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "x.cu")
        open(src, "w").close()
        try:
            out = subprocess.run([nvcc, "-dryrun", "-c", src, "-o", os.path.join(d, "x.o")],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
    m = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.M)
    if m:
        return os.path.dirname(m.group(1).strip())
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))


def is_toolkit(home):
    return bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc")) and any(
        os.path.isfile(os.path.join(home, d, "include", "cuda_runtime.h"))
        for d in ("", "targets/x86_64-linux", "targets/sbsa-linux"))


def find_cuda(torch):
    """(toolkit home, None) for a toolkit that matches torch's CUDA, else (None, reason)."""
    if os.environ.get("PPO_KERNELS_NO_CUDA") == "1":
        return None, "PPO_KERNELS_NO_CUDA=1"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU-only build"
    if not glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")):
        return None, "no CUDA sources"
    want = version_tuple(torch.version.cuda)[:2]
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if explicit:
        candidates = [("CUDA_HOME" if os.environ.get("CUDA_HOME") else "CUDA_PATH", explicit)]
    else:
        candidates = []
        nvcc = shutil.which("nvcc")
        if nvcc:
            candidates.append((f"nvcc on PATH ({nvcc})", nvcc_home(nvcc)))
        for home in ("/usr/local/cuda", f"/usr/local/cuda-{want[0]}.{want[1]}",
                     f"/usr/local/cuda-{want[0]}", "/opt/cuda"):
            candidates.append((home, home))
    seen = []
    for origin, home in candidates:
        if not home or os.path.realpath(home) in [os.path.realpath(h) for h, _ in seen]:
            continue
        if not is_toolkit(home):
            if explicit:
                fail(f"{origin}={home} is not a CUDA toolkit (no bin/nvcc and "
                     f"include/cuda_runtime.h); point it at one, or unset it, or set "
                     f"PPO_KERNELS_NO_CUDA=1 for a build without CUDA")
            continue
        ver = nvcc_version(os.path.join(home, "bin", "nvcc"))
        seen.append((home, ver))
        if ver is not None and ver[0] == want[0]:
            if ver != want:
                say(f"nvcc {ver[0]}.{ver[1]} at {home}, torch was built with CUDA "
                    f"{torch.version.cuda}: same major version, building")
            return home, None
    found = ", ".join(f"{h} (nvcc {'.'.join(map(str, v)) if v else '?'})" for h, v in seen)
    reason = (f"torch {torch.__version__} needs a CUDA {want[0]}.x toolkit; found "
              f"{found or 'none'}")
    say(f"building without CUDA kernels: {reason}. The CPU kernels are built, and the "
        f"Triton backend runs on GPUs. For the CUDA kernels install a CUDA {want[0]}.x "
        f"toolkit and set CUDA_HOME to it, then rebuild.")
    return None, reason


def gpu_visible(torch):
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:  # a broken driver: as if none
        return False


def max_jobs():
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover (not Linux)
        cores = os.cpu_count() or 1
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover
        pass
    jobs = cores if avail is None else min(cores, int(avail // (GIB_PER_JOB << 30)))
    return max(1, jobs), cores, avail


def parallel_builds(n_ext, jobs):
    """How many of the n_ext extensions compile at once, each with a ninja of jobs jobs:
    all of them where the available memory holds GIB_PER_JOB per job of every one, else
    fewer (at least one). On 2 cores the build is then the sum of the files' CPU time over
    the cores, not each module's longest file in turn (_C's CUDA unit alone kept one core
    idle for ~40 s)."""
    avail = max_jobs()[2]
    fit = n_ext if avail is None else int(avail // ((GIB_PER_JOB << 30) * max(1, jobs)))
    return max(1, min(n_ext, fit))


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def simd_caps():
    """The CPU modules to build: every SIMD capability of the platform, or with
    PPO_KERNELS_CPU_CAPABILITIES=native the one this processor runs (ATen's own choice,
    torch.backends.cpu.get_cpu_capability(); what `make demo` builds: a third of the CPU
    build), or a comma list of default / avx2 / avx512."""
    caps = ["default"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        caps += ["avx2", "avx512"]
    want = os.environ.get("PPO_KERNELS_CPU_CAPABILITIES", "all").strip().lower()
    if want in ("", "all"):
        return caps
    if want == "native":
        import torch

        native = torch.backends.cpu.get_cpu_capability().lower()
        return [native if native in caps else "default"]
    chosen = [c.strip() for c in want.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(caps))
    if unknown or not chosen:
        fail(f"PPO_KERNELS_CPU_CAPABILITIES={want!r}: expected all, native or a comma list "
             f"of {', '.join(caps)} (this platform's)")
    return [c for c in caps if c in chosen]


def _read(path):
    with open(path) as f:
        return f.read()


def cuda_units(torch):
    """The CUDA_UNITS as generated .cu files in build/ (rewritten only when their text
    changes, so that ninja rebuilds only what changed), relative to ROOT."""
    names = {os.path.splitext(os.path.basename(p))[0] for p in rel("csrc/cuda/*.cu")}
    listed = [n for unit in CUDA_UNITS for n in unit]
    if sorted(listed) != sorted(names):
        fail(f"setup.py CUDA_UNITS lists {sorted(listed)}; csrc/cuda holds {sorted(names)}: "
             f"put each .cu file in exactly one unit")
    out_dir = os.path.join(build_base(torch), "cuda_units")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i, unit in enumerate(CUDA_UNITS):
        text = "// generated by setup.py (CUDA_UNITS)\n" + "".join(
            f'#include "{os.path.join(ROOT, "csrc", "cuda", n + ".cu")}"\n' for n in unit)
        path = os.path.join(out_dir, f"unit{i}.cu")
        if not os.path.isfile(path) or _read(path) != text:
            with open(path, "w") as f:
                f.write(text)
        paths.append(os.path.relpath(path, ROOT))
    return paths


PCH_HEADER = "csrc/cpu/torch_headers.h"


def pch_header(torch, cap):
    """Where capability cap's copy of PCH_HEADER lives in build/, its precompiled form
    (".gch") beside it: GCC looks for the .gch next to the header an -include names."""
    return os.path.join(build_base(torch), "pch", cap, os.path.basename(PCH_HEADER))


def is_gcc(cxx):
    try:
        out = subprocess.run([cxx, "-dM", "-E", "-x", "c++", os.devnull],
                             capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "__GNUC__" in out and "__clang__" not in out


def precompile_headers(compiler, ext):
    """Precompiles the copy of PCH_HEADER that ext's files -include (a _cpu_<cap> module),
    with the flags ninja compiles them with: torch's BuildExtension runs
    `$cxx $cflags -c $in -o $out $post_cflags`, cflags being the -D / -I options and the
    compiler's own flags (compiler_so), post_cflags ext's extra_compile_args. Redone when
    the command or the header's text changes (a stamp beside it); the copy is rewritten
    only when its text changes, so that ninja recompiles the files that include it then
    and only then (other flags change ninja's own command lines). With a compiler other
    than GCC, or when precompiling fails, the copy is included as plain text: the build is
    slower, not different. Returns the seconds spent."""
    args = list(ext.extra_compile_args["cxx"])
    i = args.index("-include")
    header = args[i + 1]
    del args[i:i + 2]
    text = _read(os.path.join(ROOT, PCH_HEADER))
    cxx = os.environ.get("CXX", "c++")  # torch's ninja file compiles with this
    cmd = [cxx, *[f"-D{n}" if v is None else f"-D{n}={v}" for n, v in ext.define_macros],
           *[f"-I{d}" for d in ext.include_dirs], *compiler.compiler_so[1:],
           "-x", "c++-header", "-c", header, "-o", header + ".gch", *args]
    stamp = "\n".join(cmd) + "\n" + text
    stamp_path = header + ".stamp"
    os.makedirs(os.path.dirname(header), exist_ok=True)
    same_text = os.path.isfile(header) and _read(header) == text
    if same_text and os.path.isfile(header + ".gch") and os.path.isfile(stamp_path) and \
            _read(stamp_path) == stamp:
        return 0.0
    for path in (header + ".gch", stamp_path):
        if os.path.exists(path):
            os.remove(path)
    if not same_text:
        with open(header, "w") as f:  # a new mtime: ninja recompiles what includes it
            f.write(text)
    if not is_gcc(cxx):
        say(f"{cxx} is not GCC: the torch headers are not precompiled for {ext.name}")
        return 0.0
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        say(f"precompiling the torch headers for {ext.name} failed (compiling without): "
            f"{r.stderr[-2000:]}")
        if os.path.exists(header + ".gch"):
            os.remove(header + ".gch")
        return 0.0
    with open(stamp_path, "w") as f:
        f.write(stamp)
    return time.monotonic() - t0


def extensions(cpp_extension, cuda, torch):
    include = [os.path.join(ROOT, "csrc")]
    c_sources = rel("csrc/*.cpp")
    macros = [("PPO_KERNELS_WITH_CUDA", "1" if cuda else "0")]
    if cuda:
        ext = cpp_extension.CUDAExtension(
            # the two long units first: ninja starts the jobs in this order
            "ppo_kernels._C", cuda_units(torch) + c_sources, include_dirs=list(include),
            define_macros=macros,
            extra_compile_args={"cxx": CXX_FLAGS,
                                "nvcc": ["-O3", "-std=c++20",
                                         "-lineinfo", "--expt-relaxed-constexpr"]})
    else:
        ext = cpp_extension.CppExtension("ppo_kernels._C", c_sources,
                                         include_dirs=list(include), define_macros=macros,
                                         extra_compile_args={"cxx": CXX_FLAGS})
    exts = [ext]
    for cap in simd_caps():
        exts.append(cpp_extension.CppExtension(
            f"ppo_kernels._cpu_{cap}", rel("csrc/cpu/*.cpp"), include_dirs=list(include),
            extra_compile_args={"cxx": CXX_FLAGS + SIMD[cap] + [
                "-Winvalid-pch", "-include", pch_header(torch, cap)]},
            extra_link_args=["-fopenmp"]))
    return exts


def build_meta(torch, cuda_home, cuda_skipped):
    return {
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "cuda": bool(cuda_home),
        "cuda_home": cuda_home,
        "cuda_skipped": cuda_skipped,
        "cuda_arch_list": (os.environ.get("TORCH_CUDA_ARCH_LIST") or "the visible GPUs'")
        if cuda_home else None,
        "cpu_capabilities": simd_caps(),
        "platform": platform.machine(),
    }


def build_base(torch):
    """build/ of this Python and torch: builds for another torch never mix with it."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"
    return os.path.join(ROOT, "build", tag)


def build_ext_class(cpp_extension, torch, meta):
    use_ninja = cpp_extension.is_ninja_available()
    if not use_ninja:
        say("ninja not found: compiling one file at a time (`pip install ninja` makes the "
            "build parallel and rebuilds incremental)")
    base_cls = cpp_extension.BuildExtension.with_options(use_ninja=use_ninja)

    class build_ext(base_cls):
        """torch's BuildExtension, plus: each extension compiles in its own folder of a
        persistent build/ directory (the three SIMD variants compile the same files with
        other flags; with a folder each, ninja reuses every object a previous build left,
        e.g. the editable build's when a wheel is built next), the extensions compile side
        by side (setuptools' parallel build_ext: a thread each; parallel_builds says how
        many), and ppo_kernels/_build_meta.py is written beside the compiled modules."""

        # the folder of the extension a thread compiles (setuptools reads build_temp in
        # build_extension; its threads share this command object)
        _this_thread = threading.local()

        @property
        def build_temp(self):
            return getattr(self._this_thread, "temp", None) or self.__dict__.get("_temp")

        @build_temp.setter
        def build_temp(self, value):
            self.__dict__["_temp"] = value

        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join(build_base(torch), "temp")
            if self.parallel is None:
                self.parallel = parallel_builds(len(self.extensions or ()),
                                                int(os.environ.get("MAX_JOBS", "1")))
            n = len(self.extensions or ())
            at_once = n if self.parallel is True else min(n, int(self.parallel or 1))
            progress(f"compiling {n} modules, {at_once} at a time ({USUAL}); ninja "
                     f"recompiles only what changed")

        def build_extension(self, ext):
            name = ext.name.rsplit(".", 1)[-1]
            self._this_thread.temp = os.path.join(self.__dict__["_temp"], name)
            if name == "_C":
                what = WHAT["_C_cuda" if any(s.endswith(".cu") for s in ext.sources) else "_C"]
            else:
                what = WHAT["_cpu"].format(name[5:])
            t0 = time.monotonic()
            if name.startswith("_cpu_"):
                took = precompile_headers(self.compiler, ext)
                if took:
                    progress(f"{ext.name}: torch headers precompiled in {took:.0f} s")
            progress(f"compiling {ext.name}, {len(ext.sources)} files: {what}")
            try:
                super().build_extension(ext)
            finally:
                self._this_thread.temp = None
            progress(f"{ext.name} done in {time.monotonic() - t0:.0f} s")

        def run(self):
            super().run()
            text = ("# Written by setup.py when the extension was built; _extension.py reads "
                    "it before it loads the compiled modules.\nBUILD = " + repr(meta) + "\n")
            dirs = {os.path.join(self.build_lib, "ppo_kernels")}
            if self.inplace:
                dirs.add(os.path.dirname(os.path.abspath(
                    self.get_ext_fullpath("ppo_kernels._C"))))
            for d in dirs:
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, "_build_meta.py"), "w") as f:
                    f.write(text)

        def get_outputs(self):
            return super().get_outputs() + [
                os.path.join(self.build_lib, "ppo_kernels", "_build_meta.py")]

    return build_ext


def main():
    torch = import_torch()
    cuda_home, cuda_skipped = find_cuda(torch)
    if cuda_home:
        # before torch.utils.cpp_extension is imported: it reads CUDA_HOME once, and left
        # to itself takes the parent folder of the nvcc on PATH, which may be a wrapper's
        os.environ["CUDA_HOME"] = cuda_home
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not gpu_visible(torch):
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS
            say(f"no GPU visible: TORCH_CUDA_ARCH_LIST={DEFAULT_ARCHS}")
    if not os.environ.get("MAX_JOBS", "").isdigit():
        jobs, cores, avail = max_jobs()
        os.environ["MAX_JOBS"] = str(jobs)
        say(f"MAX_JOBS={jobs} ({cores} cores, "
            f"{'?' if avail is None else round(avail / 2**30, 1)} GiB available)")

    from setuptools import setup
    from torch.utils import cpp_extension

    if cuda_home:
        cpp_extension.CUDA_HOME = cuda_home  # in case it was imported before this file ran
    meta = build_meta(torch, cuda_home, cuda_skipped)
    setup(
        ext_modules=extensions(cpp_extension, bool(cuda_home), torch),
        cmdclass={"build_ext": build_ext_class(cpp_extension, torch, meta)},
        # the wheel runs only under the torch it was compiled against: pin it (a source
        # build needs torch >= OLDEST_TORCH, checked in import_torch)
        install_requires=[f"torch=={torch.__version__.split('+')[0]}", "numpy"],
        options={"build": {"build_base": build_base(torch)}},
    )


if __name__ == "__main__":  # pip, uv and python -m build run it so; tests import it
    main()
