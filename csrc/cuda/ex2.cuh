// 2^x in float for the per-element exponentials of the sweeps (row_reduce.cuh's vexp2,
// threshold_select.cuh's kept statistics): on the device one MUFU.EX2, the PTX
// ex2.approx.ftz.f32 (max error 2 ulp, the instruction inside CUDA's exp2f: PTX ISA, "ex2")
// without exp2f's denormal fix-up around it (a result below 2^-126 is 0); on the host, for
// the emulations, glibc's exp2f (< 1 ulp).
#pragma once

#include <cmath>

namespace ppo_cuda {

__host__ __device__ __forceinline__ float ex2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

}  // namespace ppo_cuda
