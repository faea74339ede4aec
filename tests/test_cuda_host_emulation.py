"""The CUDA kernels' per-thread code, run on the CPU: csrc/cuda/host_check/*.cu compile the
kernels' own __host__ __device__ pieces (row sweeps, shifted 16-byte loads, statistics
merges, GAE scan phases) as host code with nvcc and check them against long-double
references. emulate_rows also emulates the warp butterflies and chunk merges lane by lane in
the kernels' order and checks that the fused and split schedules, and every address phase of
a row, give the same bits (batch invariance), and runs the ppo_loss per-token epilogue
(token_epilogue.cuh) over the loss menu (vanilla / cispo / sapo, k1..k3+, KL bias
correction, on-policy, entropy weights) against a long-double formula. This is what CI can check of the CUDA backend
without a GPU (it does not cover real shuffles, barriers or launches, which the GPU tests in
the rest of the suite and benchmarks/gpu_check.sh do when a device is present)."""

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp

ROOT = Path(__file__).resolve().parents[1]
CUDA_HOME = os.environ.get("CUDA_HOME") or ("/usr/local/cuda" if Path(
    "/usr/local/cuda/bin/nvcc").exists() else None)
NVCC = str(Path(CUDA_HOME) / "bin" / "nvcc") if CUDA_HOME else shutil.which("nvcc")

FLAGS = {
    "O1": ["-O1"],
    # let the host compiler contract a * b + c into FMAs, as nvcc does on the device.
    # -fno-strict-aliasing: under nvcc's host pass the bf16 <-> float conversions of the
    # CUDA / c10 headers type-pun, which gcc -O2 miscompiles (only bf16 fails without it;
    # row_reduce.cuh itself moves bytes with memcpy)
    "O2-fma": ["-O2", "-Xcompiler", "-mfma,-ffp-contract=fast,-fno-strict-aliasing"],
}


@pytest.mark.skipif(NVCC is None or not Path(NVCC).exists(), reason="no nvcc on this machine")
@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("program", ["emulate_rows", "emulate_gae"])
def test_cuda_per_thread_code_on_host(program, flags, tmp_path):
    if flags == "O2-fma" and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("-mfma is an x86 flag")
    exe = tmp_path / program
    subprocess.run([NVCC, "-std=c++20", *FLAGS[flags], "--expt-relaxed-constexpr",
                    "-diag-suppress", "177", "-I", str(ROOT / "csrc"), "-I",
                    cpp.include_paths()[0],
                    str(ROOT / "csrc" / "cuda" / "host_check" / f"{program}.cu"), "-o",
                    str(exe)], check=True, capture_output=True, text=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "passed" in run.stdout.splitlines()[-1], run.stdout[-4000:]
