"""Every CPU SIMD build the wheel ships (setup.py: _cpu_default, _cpu_avx2, _cpu_avx512)
computes the same function. The process loads the best one the processor runs, so the
others are exercised in subprocesses with ATEN_CPU_CAPABILITY forced lower (the same
switch ATen honours for its own kernels); each compares ppo_loss / token_logprobs / gae
with the float64 reference."""

import os
import platform
import subprocess
import sys

import pytest
import torch

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
