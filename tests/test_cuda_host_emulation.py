"""The CUDA kernels' per-thread code, run on the CPU: csrc/cuda/host_check/*.cu compile the
kernels' own __host__ __device__ pieces (row sweeps, GAE scan phases) as host code with
nvcc and check them against long-double references. This is what CI can check of the
CUDA backend without a GPU (it does not cover warp shuffles, barriers or launches, which
the GPU tests in the rest of the suite do when a device is present)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp

ROOT = Path(__file__).resolve().parents[1]
CUDA_HOME = os.environ.get("CUDA_HOME") or ("/usr/local/cuda" if Path(
    "/usr/local/cuda/bin/nvcc").exists() else None)
NVCC = str(Path(CUDA_HOME) / "bin" / "nvcc") if CUDA_HOME else shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None or not Path(NVCC).exists(), reason="no nvcc on this machine")
@pytest.mark.parametrize("program", ["emulate_rows", "emulate_gae"])
def test_cuda_per_thread_code_on_host(program, tmp_path):
    exe = tmp_path / program
    subprocess.run([NVCC, "-std=c++20", "-O1", "--expt-relaxed-constexpr", "-I",
                    str(ROOT / "csrc"), "-I", cpp.include_paths()[0],
                    str(ROOT / "csrc" / "cuda" / "host_check" / f"{program}.cu"), "-o",
                    str(exe)], check=True, capture_output=True, text=True, timeout=300)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "passed" in run.stdout.splitlines()[-1], run.stdout[-4000:]
