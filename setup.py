"""Builds ppo_kernels._C (operator schemas, CUDA kernels when a toolkit and a CUDA torch
exist, build_info) and the CPU kernels once per SIMD capability (_cpu_default, _cpu_avx2,
_cpu_avx512); ppo_kernels/_ops.py loads the best one this processor runs, as ATen does.

Environment: CUDA_HOME=/usr/local/cuda, TORCH_CUDA_ARCH_LIST="9.0" and MAX_JOBS=2 on the
build machines (DESIGN.md, build notes); PPO_KERNELS_NO_CUDA=1 skips the CUDA sources.
"""

import glob
import os
import platform

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-Wall", "-Wno-unused-function"]
# Flags ATen uses for its own per-capability kernels (cmake/Codegen.cmake).
SIMD = {
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2",
             "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
}


def rel(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def want_cuda():
    if os.environ.get("PPO_KERNELS_NO_CUDA") == "1":
        return False
    import torch

    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and bool(
        rel("csrc/cuda/*.cu"))


def extensions():
    include = [os.path.join(ROOT, "csrc")]
    cuda = want_cuda()
    c_sources = rel("csrc/*.cpp")
    macros = [("PPO_KERNELS_WITH_CUDA", "1" if cuda else "0")]
    if cuda:
        ext = cpp_extension.CUDAExtension(
            "ppo_kernels._C", c_sources + rel("csrc/cuda/*.cu"), include_dirs=include,
            define_macros=macros,
            extra_compile_args={"cxx": CXX_FLAGS,
                                "nvcc": ["-O3", "-std=c++20",
                                         "-lineinfo", "--expt-relaxed-constexpr"]})
    else:
        ext = cpp_extension.CppExtension("ppo_kernels._C", c_sources, include_dirs=include,
                                         define_macros=macros,
                                         extra_compile_args={"cxx": CXX_FLAGS})
    exts = [ext]
    simd = ["default"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        simd += ["avx2", "avx512"]
    for cap in simd:
        exts.append(cpp_extension.CppExtension(
            f"ppo_kernels._cpu_{cap}", rel("csrc/cpu/*.cpp"), include_dirs=include,
            extra_compile_args={"cxx": CXX_FLAGS + SIMD[cap]},
            extra_link_args=["-fopenmp"]))
    return exts


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
