"""The C++ kernels of csrc/, below the public API.

- The CPU SIMD builds: every build the wheel ships (setup.py: _cpu_default, _cpu_avx2,
  _cpu_avx512) computes the same function. The process loads the best one the processor
  runs, so the others are exercised in subprocesses with ATEN_CPU_CAPABILITY forced lower
  (the same switch ATen honours for its own kernels); each compares ppo_loss /
  token_logprobs / gae with the float64 reference.
- The CPU kernels on their own: bit-identical results for any thread count and from run
  to run; a vocabulary past 2^17 (several vocabulary blocks) against the eager composite;
  the raw torch.ops.ppo_kernels ops reject bad arguments with an error, never a crash or
  an out-of-bounds read.
- The CUDA kernels' per-thread code, run on the CPU: csrc/cuda/host_check/*.cu compile the
  kernels' own __host__ __device__ pieces (row sweeps, shifted 16-byte loads, statistics
  merges, GAE scan phases) as host code with nvcc and check them against long-double
  references. emulate_rows also emulates the warp butterflies and chunk merges lane by
  lane in the kernels' order and checks that the fused and split schedules, and every
  address phase of a row, give the same bits (batch invariance), and runs the ppo_loss
  per-token epilogue (token_epilogue.cuh) over the loss menu (vanilla / cispo / sapo,
  k1..k3+, KL bias correction, on-policy, entropy weights) against a long-double formula.
  emulate_threshold runs the re-derived threshold's block program (threshold_select.cuh)
  step by step with a host block policy on bfloat16 / float16 rows against the CPU op's
  rules. This is what CI can check of the CUDA backend without a GPU (it does not cover real
  shuffles, barriers or launches, which the CUDA-parametrised tests of the suite and the
  device checks in tests/gpu/ (driven by benchmarks/gpu_check.sh) do when a device is
  present).
"""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension as cpp

import ppo_kernels as pk

from helpers.inputs import small_inputs
from helpers.raw_ops import kernel_args

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ the CPU SIMD builds

CHECK = r"""
import numpy as np, torch, ppo_kernels as pk
from ppo_kernels import reference as R
assert pk.build_info()["cpu_capability"] == "{cap}", pk.build_info()
g = torch.Generator().manual_seed(7)
for dtype, tol in ((torch.float32, 3e-6), (torch.bfloat16, 1e-2), (torch.float64, 1e-10)):
    for V in (1, 7, 37, 1000):
        B, T = 3, 5
        logits = (torch.randn(B, T + 1, V, generator=g) * 2).to(dtype)
        if V > 1:
            logits[0, 1, 0] = -float("inf")
        tokens = torch.randint(0, V, (B, T), generator=g)
        mask = torch.rand(B, T, generator=g) > 0.3
        old = torch.randn(B, T, generator=g) * 0.3 - np.log(V + 1)
        adv = torch.randn(B, T, generator=g)
        ref = torch.randn(B, T, generator=g) * 0.1 - np.log(V + 1)
        x = logits.clone().requires_grad_(True)
        kw = dict(kl_coef=0.1, entropy_coef=0.01, dual_clip_c=3.0, temperature=0.7)
        loss, _ = pk.ppo_loss(x, tokens, old, adv, mask, ref, backend="cpu", **kw)
        loss.backward()
        rl, _, rd = R.ppo_loss(logits, tokens, old, adv, mask, ref, **kw)
        assert abs(float(loss) - rl) <= 2e-5 * max(abs(rl), 1e-3), (dtype, V, float(loss), rl)
        err = np.abs(x.grad.double().numpy() - rd).max() / max(np.abs(rd).max(), 1e-30)
        assert err <= tol, (dtype, V, err)
        lp = pk.token_logprobs(logits, tokens, mask, backend="cpu")
        rlp, _ = R.token_logprobs(logits, tokens, mask)
        assert np.abs(lp.double().numpy() - rlp).max() <= 1e-5, (dtype, V)
r, v = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
m = torch.rand(3, 9, generator=g) > 0.3
a, ret = pk.gae(r, v, m, gamma=0.99, lam=0.9, backend="cpu")
ra, rr = R.gae(r, v, m, gamma=0.99, lam=0.9)
assert np.abs(a.numpy() - ra).max() < 1e-5 and np.abs(ret.numpy() - rr).max() < 1e-5
kw = dict(gamma=0.99, lam="length-adaptive", lam_alpha=0.3, value_lam=1.0)
a, ret = pk.gae(r, v, m, backend="cpu", **kw)
ra, rr = R.gae(r, v, m, **kw)
assert np.abs(a.numpy() - ra).max() < 1e-5 and np.abs(ret.numpy() - rr).max() < 1e-5
print("ok")
"""

CAPS = ["default"]
if platform.machine().lower() in ("x86_64", "amd64"):
    CAPS.append("avx2")  # avx512 is the main process's on this machine's kind


@pytest.mark.parametrize("cap", CAPS)
def test_lower_simd_builds_match_reference(cap):
    best = torch.backends.cpu.get_cpu_capability().lower()
    order = ["default", "avx2", "avx512"]
    if best in order and order.index(cap) > order.index(best):
        pytest.skip(f"this processor does not run {cap}")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
    out = subprocess.run([sys.executable, "-c", CHECK.replace("{cap}", cap)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


# ------------------------------------------------------------------ the CPU kernels

def test_cpu_deterministic_across_threads_and_runs():
    """The CPU kernels' loss, dlogits and every metric are bit-identical with 1 or 2 threads
    and from one run to the next (float32 and bfloat16 logits)."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 4, 8, 4099
    L = torch.randn(B, T, V, generator=g) * 3
    tk = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) * 5
    adv = torch.randn(B, T, generator=g)
    prev = torch.get_num_threads()
    outs = []
    try:
        for nt in (1, 2, 2):
            torch.set_num_threads(nt)
            for dtype in (torch.float32, torch.bfloat16):
                logits = L.to(dtype).detach().clone().requires_grad_()
                loss, m = pk.ppo_loss(logits, tk, old, adv, ref_logprobs=old + 0.1,
                                      kl_coef=0.1, entropy_coef=0.01, backend="cpu")
                loss.backward()
                outs.append((loss.detach(), logits.grad, *[m[k] for k in sorted(m)]))
    finally:
        torch.set_num_threads(prev)
    for run in (outs[2], outs[4]):
        assert all(torch.equal(a, b) for a, b in zip(outs[0], run))
    for run in (outs[3], outs[5]):
        assert all(torch.equal(a, b) for a, b in zip(outs[1], run))


def test_large_vocab_cpu_matches_torch():
    """V = 2^17 + 3 (many vocabulary blocks, the last one partial; a sampled token at the last
    id): the CPU kernel's loss, dlogits and entropy agree with the eager composite."""
    g = torch.Generator().manual_seed(5)
    B, T, V = 2, 3, 2**17 + 3
    L = torch.randn(B, T, V, generator=g) * 3
    tk = torch.randint(0, V, (B, T), generator=g)
    tk[0, 0] = V - 1
    old, adv = -torch.rand(B, T, generator=g) - 11, torch.randn(B, T, generator=g)
    out = []
    for be in ("cpu", "torch"):
        logits = L.clone().requires_grad_()
        loss, m = pk.ppo_loss(logits, tk, old, adv, entropy_coef=0.01, backend=be)
        loss.backward()
        out.append((loss.detach(), logits.grad, m["entropy"]))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-7)


def test_raw_cpu_ops_reject_bad_input_without_crashing():
    """The raw CPU ops, called without the public API's checks in front, raise an error
    (never crash or read out of bounds) for out-of-range or non-int64 tokens, a non-bool
    mask, logits shorter than the tokens or with a non-unit vocabulary stride, statistics
    of the wrong shape, an unknown KL estimator or policy-loss code, too few scalars or too
    many codes, a per-token input of another dtype or shape, a non-contiguous or mis-sized
    GAE input, and score_rollout's out-of-range tokens or mis-sized scores."""
    ops = torch.ops.ppo_kernels
    d = small_inputs()
    L, tk, m = d["logits"], d["tokens"], torch.ones(2, 3, dtype=torch.bool)
    O, A, W = torch.zeros(2, 3), torch.ones(2, 3), torch.full((2, 3), 1 / 6)
    fs, codes = kernel_args()
    ops.ppo_loss_fwd(L, tk, m, O, A, W, None, None, None, fs, codes, True)  # the good call
    bad = [
        lambda: ops.token_logprobs_fwd(L, torch.full((2, 3), 5), m, 1.0, False),
        lambda: ops.token_logprobs_fwd(L, torch.full((2, 3), -1), m, 1.0, False),
        lambda: ops.token_logprobs_fwd(L, tk.int(), m, 1.0, False),
        lambda: ops.token_logprobs_fwd(L, tk, m.int(), 1.0, False),
        lambda: ops.token_logprobs_fwd(L[:, :2], tk, m, 1.0, False),
        lambda: ops.token_logprobs_fwd(torch.randn(2, 3, 10)[..., ::2], tk, m, 1.0, False),
        lambda: ops.token_logprobs_bwd(O, None, L, tk, m, O[:, :1], O, 1.0),
        lambda: ops.token_logprobs_bwd(O, None, L, torch.full((2, 3), 10**9), m, O, O, 1.0),
        lambda: ops.ppo_loss_fwd(L, tk, m, O, A, W, None, None, None, fs, [0, 7, 0], True),
        lambda: ops.ppo_loss_fwd(L, tk, m, O, A, W, None, None, None, fs, [5, 2, 0], True),
        lambda: ops.ppo_loss_fwd(L, tk, m, O, A, W, None, None, None, fs[:-1], codes, True),
        lambda: ops.ppo_loss_fwd(L, tk, m, O, A, W, None, None, None, fs, [*codes, 0], True),
        lambda: ops.ppo_loss_fwd(L, tk, m, O.double(), A, W, None, None, None, fs, codes, True),
        lambda: ops.ppo_loss_fwd(L, tk, m, O, A[:, :2], W, None, None, None, fs, codes, True),
        lambda: ops.ppo_loss_fwd(L, torch.full((2, 3), 10**9), m, O, A, W, None, None, None, fs,
                                 codes, True),
        lambda: ops.gae(torch.randn(3, 2).t(), O, m, None, 1., .9),
        lambda: ops.gae(O, O, m, torch.zeros(5), 1., .9),
        lambda: ops.gae(O, O, m, None, 1., .9, torch.zeros(3)),  # lam_per_seq: [B] = [2]
        lambda: ops.gae(O, O, m, None, 1., .9, torch.zeros(2, dtype=torch.float64)),
        lambda: ops.gae(O, O, m, None, 1., .9, torch.tensor([0.5, 1.5])),
        lambda: ops.gae(O, O, m, None, 1., .9, torch.tensor([0.5, float("nan")])),
        lambda: ops.gae(O, O, m, None, 1., .9, None, 1.5),
        lambda: ops.gae(O, O, m, None, 1., .9, None, -0.1),
        lambda: ops.score_rollout(L, tk, m, O, O, torch.zeros(2), .1, 0, 1., .9, 1.,
                                  torch.tensor([0.5, -0.5])),
        lambda: ops.score_rollout(L, tk, m, O, O, torch.zeros(2), .1, 0, 1., .9, 1., None, 2.),
        lambda: ops.score_rollout(L, torch.full((2, 3), 5), m, O, O, torch.zeros(2), .1, 0, 1.,
                                  .9, 1.),
        lambda: ops.score_rollout(L, tk, m, O, O, torch.zeros(3), .1, 0, 1., .9, 1.),
    ]
    for f in bad:
        with pytest.raises((RuntimeError, ValueError, TypeError, NotImplementedError)):
            f()


def test_raw_cpu_score_rollout_rejects_unknown_kl_estimator():
    """score_rollout's kl_estimator code 9 (there are six) is an error."""
    d = small_inputs()
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises((RuntimeError, ValueError)):
        torch.ops.ppo_kernels.score_rollout(d["logits"], d["tokens"], m, d["ref"],
                                            torch.zeros(2, 3), torch.zeros(2), 0.1, 9, 1.0,
                                            0.9, 1.0)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_raw_cpu_ops_reject_non_positive_temperature(temperature):
    """token_logprobs_fwd with a temperature of 0 or below is an error."""
    d = small_inputs()
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises((RuntimeError, ValueError)):
        torch.ops.ppo_kernels.token_logprobs_fwd(d["logits"], d["tokens"], m, temperature,
                                                 False)


# ------------------------------------------------------------------ CUDA code on the host

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
@pytest.mark.parametrize("program", ["emulate_rows", "emulate_gae", "emulate_threshold"])
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


@pytest.mark.skipif(not pk.build_info().get("cuda"),
                    reason="the extension was built without CUDA (no nvcc)")
def test_cuda_sweeps_instruction_counts_are_read():
    """benchmarks/cuda_sass.py reads each row kernel's vocabulary sweeps off the build's
    sm_90 SASS (csrc/cuda/NOTES.md's figures): every kernel and dtype is found and has a
    plausible count (a figure, never a bound on it)."""
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cuda_sass.py")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    seen = {tuple(line.split()[:2]) for line in lines}
    for kernel in ("partial_stats_kernel", "grad_chunks_kernel", "fused_rows_kernel",
                   "cluster_rows_kernel"):
        for dtype in ("bf16", "float32"):
            assert (kernel, dtype) in seen, (kernel, dtype, run.stdout)
    per = [float(line.rsplit(":", 1)[1].split()[0]) for line in lines]
    assert per and all(4.0 < p < 200.0 for p in per), run.stdout
