"""Loads the compiled extension: ppo_kernels._C (operator schemas, CUDA kernels,
build_info) and the CPU kernels, compiled once per SIMD capability (setup.py). The best CPU
module this processor runs is loaded, the same choice ATen makes for its own kernels (it
honours ATEN_CPU_CAPABILITY, so a lower one can be forced for testing).
"""

from __future__ import annotations

import importlib

import torch

_C = None
CPU_CAPABILITY = None
_CPU_MODULE = None
LOAD_ERROR = None
try:
    from . import _C  # noqa: F811  (schemas, CUDA kernels, build_info)

    _order = {"AVX512": ("avx512", "avx2", "default"), "AVX2": ("avx2", "default")}
    for _cap in _order.get(torch.backends.cpu.get_cpu_capability(), ("default",)):
        try:
            _CPU_MODULE = importlib.import_module(f"ppo_kernels._cpu_{_cap}")
            CPU_CAPABILITY = _cap
            break
        except ImportError as e:  # a capability not built on this platform
            LOAD_ERROR = e
except ImportError as e:
    LOAD_ERROR = e

HAS_SCHEMAS = _C is not None  # the operator schemas (csrc/ops.cpp) come with _C
HAS_CPU = CPU_CAPABILITY is not None
HAS_CUDA = _C is not None and bool(_C.build_info()["cuda"])


def empty_cache():
    """Returns the CPU kernels' recycled gradient buffer (at most one [N, V] block, kept so
    that the next step's gradient needs no fresh, page-faulting memory) to the operating
    system. PPO_KERNELS_CPU_GRAD_CACHE=0 turns the recycling off. CUDA memory is PyTorch's
    own caching allocator's (torch.cuda.empty_cache)."""
    if _CPU_MODULE is not None:
        _CPU_MODULE.empty_cache()


def build_info():
    """Which backends were compiled, the CPU SIMD variant loaded and the thread count."""
    info = dict(_C.build_info()) if _C is not None else {"cuda": False}
    info.update(cpu=HAS_CPU, cpu_capability=CPU_CAPABILITY, num_threads=torch.get_num_threads())
    return info
