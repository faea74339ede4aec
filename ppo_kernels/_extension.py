"""Loads the compiled extension: ppo_kernels._C (operator schemas, CUDA kernels,
build_info) and the CPU kernels, compiled once per SIMD capability (setup.py). The best CPU
module this processor runs is loaded, the same choice ATen makes for its own kernels (it
honours ATEN_CPU_CAPABILITY, so a lower one can be forced for testing).

Before anything compiled is imported, the torch it was built against (recorded by setup.py
in _build_meta.py: version, CUDA version, C++ ABI, Python) is compared with the running
one: a C++ extension only loads under the torch it was compiled for (elsewhere it dies with
an undefined symbol, or worse), so a mismatch raises an ImportError that names both and the
command that rebuilds it. A source checkout that was never built imports without the
compiled kernels (backend="torch", and "triton" on a GPU); build_info() says how to build
them. PPO_KERNELS_NO_EXTENSION=1 skips the compiled kernels even when they are there.
"""

from __future__ import annotations

import glob
import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys

import torch

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_PKG_DIR)
# the package imported from a checkout (an editable install, or the source tree on
# sys.path), not from an installed copy
SOURCE_CHECKOUT = os.path.isfile(os.path.join(_ROOT, "setup.py")) and os.path.isdir(
    os.path.join(_ROOT, "csrc"))

_C = None
CPU_CAPABILITY = None
_CPU_MODULE = None
LOAD_ERROR = None
BUILD_META = None  # what setup.py recorded, or None (never built, or built before it did)


def _own(name):
    """The spec of module `name` in this package's own folder, else None. Asked of the
    path finder alone: an import hook (setuptools' editable finder, for one) may resolve
    ppo_kernels.<name> to another checkout's file."""
    return importlib.machinery.PathFinder.find_spec(f"ppo_kernels.{name}", [_PKG_DIR])


def _python():
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def _installed_from():
    """Where an installed (non-checkout) copy came from, as pip records it (PEP 610)."""
    try:
        from importlib import metadata

        text = metadata.distribution("ppo-kernels").read_text("direct_url.json")
        info = json.loads(text) if text else None
    except Exception:
        return None
    if not info or "url" not in info:
        return None
    url = info["url"]
    if "vcs_info" in info:
        commit = info["vcs_info"].get("commit_id")
        return f"git+{url}" + (f"@{commit}" if commit else "")
    if "dir_info" in info and url.startswith("file://"):
        return url[len("file://"):]
    return None  # a wheel file: it was built elsewhere


def rebuild_command():
    """The command that (re)builds the compiled kernels for the running torch."""
    py = sys.executable or "python"
    if SOURCE_CHECKOUT:
        return f"{py} -m pip install --no-build-isolation -e {_ROOT}"
    src = _installed_from() or "<the ppo-kernels source: a checkout or a git+URL>"
    return f"{py} -m pip install --no-build-isolation --no-deps --force-reinstall {src}"


def _describe(version, cuda, abi, python):
    return (f"torch {version} ({'CUDA ' + cuda if cuda else 'CPU-only'}, "
            f"C++11 ABI {'on' if abi else 'off'}, Python {python})")


def _mismatch(meta):
    """The ImportError for a build recorded for another torch or Python, else None."""
    running = (torch.__version__, torch.version.cuda,
               bool(torch._C._GLIBCXX_USE_CXX11_ABI), _python())
    built = (meta.get("torch_version"), meta.get("torch_cuda"),
             meta.get("torch_cxx11_abi"), meta.get("python"))
    if built == running:
        return None
    pin = str(built[0]).split("+")[0]
    return ImportError(
        f"ppo_kernels was compiled against {_describe(*built)}, but this is "
        f"{_describe(*running)}; a C++ extension only loads under the torch it was built "
        f"for. Rebuild it for this torch:\n    {rebuild_command()}\n"
        f"or go back to torch {pin} (pip install torch=={pin}); "
        f"PPO_KERNELS_NO_EXTENSION=1 imports without the compiled kernels "
        f"(backend='torch', or 'triton' on a GPU).")


def _broken(what, err):
    return ImportError(
        f"ppo_kernels: the compiled {what} does not load ({type(err).__name__}: {err}); "
        f"the build is incomplete or was made for another torch or toolchain. Rebuild it:\n"
        f"    {rebuild_command()}\n"
        f"PPO_KERNELS_NO_EXTENSION=1 imports without the compiled kernels.")


def _load():
    global _C, CPU_CAPABILITY, _CPU_MODULE, LOAD_ERROR, BUILD_META
    if os.environ.get("PPO_KERNELS_NO_EXTENSION") == "1":
        LOAD_ERROR = ImportError("the compiled kernels were not loaded "
                                 "(PPO_KERNELS_NO_EXTENSION=1)")
        return
    if "ppo_kernels._build_meta" in sys.modules or _own("_build_meta") is not None:
        from . import _build_meta

        BUILD_META = dict(_build_meta.BUILD)
        err = _mismatch(BUILD_META)
        if err is not None:
            raise err
    if _own("_C") is None:
        if BUILD_META is not None:
            raise _broken("module ppo_kernels._C", ModuleNotFoundError(
                f"_build_meta.py is there, but no _C module in {_PKG_DIR}"))
        LOAD_ERROR = ImportError(f"the C++ kernels are not built; build them with "
                                 f"`{rebuild_command()}`")
        return
    try:
        from . import _C as c  # schemas, CUDA kernels, build_info
    except ImportError as e:
        raise _broken("module ppo_kernels._C", e) from e
    _C = c
    order = {"AVX512": ("avx512", "avx2", "default"), "AVX2": ("avx2", "default")}
    built = BUILD_META.get("cpu_capabilities") if BUILD_META else None
    for cap in order.get(torch.backends.cpu.get_cpu_capability(), ("default",)):
        if (built is not None and cap not in built) or _own(f"_cpu_{cap}") is None:
            continue  # a capability not built on this platform
        try:
            _CPU_MODULE = importlib.import_module(f"ppo_kernels._cpu_{cap}")
            CPU_CAPABILITY = cap
            break
        except ImportError as e:
            raise _broken(f"CPU module ppo_kernels._cpu_{cap}", e) from e
    if CPU_CAPABILITY is None:
        LOAD_ERROR = ImportError(f"no CPU kernel module (ppo_kernels._cpu_*) in {_PKG_DIR}; "
                                 f"rebuild with `{rebuild_command()}`")


class CheckoutTritonFinder:
    """Finds ppo_kernels.triton_kernels in a source checkout that is imported without being
    installed (the source tree on sys.path or PYTHONPATH: the GPU check's in-place build,
    scripts/mutate.py's copies), or through an editable install: the top-level
    triton_kernels/ beside the package, which an install maps to that name (pyproject.toml
    package-dir). Installed only when the imported package is a checkout, first on
    sys.meta_path: a copy of the checkout (scripts/mutate.py) gets its own Triton sources,
    not those an editable install of another checkout maps. Its submodules are then found in
    that folder by the usual path search."""

    NAME = __package__ + ".triton_kernels"
    DIR = os.path.join(_ROOT, "triton_kernels")

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != cls.NAME:
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(cls.DIR, "__init__.py"), submodule_search_locations=[cls.DIR])


if SOURCE_CHECKOUT and os.path.isfile(os.path.join(CheckoutTritonFinder.DIR, "__init__.py")) \
        and CheckoutTritonFinder not in sys.meta_path:
    sys.meta_path.insert(0, CheckoutTritonFinder)

_load()
HAS_SCHEMAS = _C is not None  # the operator schemas (csrc/ops.cpp) come with _C
HAS_CPU = CPU_CAPABILITY is not None
HAS_CUDA = _C is not None and bool(_C.build_info()["cuda"])


def eager_call(name):
    """The function ``name`` of the _C module (csrc/eager_calls.cpp: fused_loss,
    metrics_dict), or None where this build has none."""
    return getattr(_C, name, None)


def empty_cache():
    """Returns the CPU kernels' recycled gradient buffer (at most one [N, V] block, kept so
    that the next step's gradient needs no fresh, page-faulting memory) to the operating
    system. PPO_KERNELS_CPU_GRAD_CACHE=0 turns the recycling off. CUDA memory is PyTorch's
    own caching allocator's (torch.cuda.empty_cache)."""
    if _CPU_MODULE is not None:
        _CPU_MODULE.empty_cache()


def _backends():
    gpu = torch.cuda.is_available()
    out = []
    if HAS_CPU:
        out.append("cpu")
    if HAS_CUDA and gpu:
        out.append("cuda")
    if importlib.util.find_spec("triton") is not None and (
            gpu or os.environ.get("TRITON_INTERPRET") == "1"):
        out.append("triton")
    return out + ["torch"]


def built_copies_elsewhere():
    """Folders on sys.path, other than the imported one, that hold a built ppo_kernels (a
    compiled _C module): an installed copy that a source checkout shadows when Python runs
    inside the checkout, say."""
    out = []
    for entry in sys.path:
        d = os.path.join(os.path.abspath(entry or os.getcwd()), "ppo_kernels")
        if os.path.realpath(d) == os.path.realpath(_PKG_DIR) or d in out:
            continue
        if glob.glob(os.path.join(d, "_C.*")):
            out.append(d)
    return out


def not_built_hint():
    """Why the compiled kernels are not here and what to do, in one sentence or two."""
    elsewhere = built_copies_elsewhere()
    if elsewhere and SOURCE_CHECKOUT:
        return (f"ppo_kernels was imported from the unbuilt source tree {_PKG_DIR}, which "
                f"shadows the built copy in {elsewhere[0]}: run Python outside the "
                f"checkout, or build the checkout in place with `{rebuild_command()}`")
    return f"{LOAD_ERROR}; build them with `{rebuild_command()}`"


def build_info():
    """What was compiled and what runs here: `built` (the C++ kernels are loaded), `cuda`
    (compiled with the CUDA kernels; `cuda_skipped` says why not), `cpu` and the SIMD
    variant loaded (`cpu_capabilities_built`: those compiled), `backends` (those usable in
    this process for backend=), the torch it was built for and the running one, `path`
    (the folder ppo_kernels was imported from) and `built_elsewhere` (other folders on
    sys.path with a built copy, which this one shadows), and, when not built,
    `load_error` and `how_to_build`."""
    info = dict(_C.build_info()) if _C is not None else {"cuda": False}
    meta = BUILD_META or {}
    info.update(built=_C is not None, cpu=HAS_CPU, cpu_capability=CPU_CAPABILITY,
                cpu_capabilities_built=meta.get("cpu_capabilities"),
                num_threads=torch.get_num_threads(), backends=_backends(),
                torch=torch.__version__, built_for_torch=meta.get("torch_version"),
                cuda_skipped=meta.get("cuda_skipped"), cuda_arch_list=meta.get("cuda_arch_list"),
                path=_PKG_DIR, built_elsewhere=built_copies_elsewhere())
    if _C is None:
        info.update(load_error=str(LOAD_ERROR), how_to_build=not_built_hint())
    return info
