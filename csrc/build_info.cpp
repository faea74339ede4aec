// ppo_kernels._C as a Python module: build_info() tells which backends were compiled;
// fused_loss and metrics_dict (csrc/eager_calls.cpp) are the eager calls of the ops whose
// per-call host cost matters.
// Plain pybind11 (not torch/extension.h) keeps this translation unit quick to compile.
#include <pybind11/pybind11.h>

void init_eager_calls(pybind11::module_& m);  // csrc/eager_calls.cpp

#ifndef PPO_KERNELS_WITH_CUDA
#define PPO_KERNELS_WITH_CUDA 0
#endif

PYBIND11_MODULE(_C, m) {
  m.def(
      "build_info",
      [] {
        pybind11::dict d;
        d["cuda"] = bool(PPO_KERNELS_WITH_CUDA);
#ifdef _OPENMP
        d["openmp"] = true;
#else
        d["openmp"] = false;
#endif
        return d;
      },
      "Which backends this build of ppo_kernels._C holds.");
  init_eager_calls(m);
}
