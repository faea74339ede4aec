"""The CPU kernels write a gradient larger than the last-level cache with non-temporal
stores (csrc/cpu/row_kernels.h stream_gradient, Lanes::stream, RowWorker::zero): the same
values as plain stores, in rows whose start is aligned for them. A child process sets
PPO_KERNELS_CPU_STREAM_BYTES=0 (every gradient streamed; the kernels read it once) and
computes the gradients of the cases below; this process, whose small gradients fit in the
cache and are stored plainly, computes them again: they must agree bit for bit. The cases
cover rows that are aligned and rows that are not (V * itemsize not a multiple of the
vector), a row's partial last chunk, masked rows and clipped tokens (zero rows), the
entropy term (the sweep that reads the logits again), the in-place backward, and
token_logprobs' backward."""

import os

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels import _extension

from helpers.child import MARKER, run_child
from helpers.inputs import make_inputs

CASES = [  # (dtype, V, options)
    (torch.float32, 64, {}),
    (torch.float32, 300, {"entropy_coef": 0.01}),
    (torch.float32, 4099, {"kl_coef": 0.1, "kl_estimator": "k3"}),
    (torch.bfloat16, 1000, {}),
    (torch.bfloat16, 515, {"entropy_coef": 0.01, "inplace_backward": True}),
    (torch.float16, 260, {}),
    (torch.float64, 136, {"entropy_coef": 0.01}),
    (torch.float32, 2048, {"inplace_backward": True}),
]


def gradients(inputs):
    """For each case: the gradient of ppo_loss (cpu backend) and of token_logprobs' logp
    sum, in the same order as CASES."""
    out = []
    for (dtype, V, opts), inp in zip(CASES, inputs):
        T = inp["tokens"].shape[1]
        x = inp["full"].clone().requires_grad_(True)
        loss, _ = pk.ppo_loss(x[:, :T] if not opts.get("inplace_backward") else x,
                              inp["tokens"], inp["old"], inp["adv"], inp["mask"],
                              ref_logprobs=inp["ref"], backend="cpu", **opts)
        loss.backward()
        out.append(x.grad)
        y = inp["full"][:, :T].clone().requires_grad_(True)
        lp = pk.token_logprobs(y, inp["tokens"], inp["mask"], backend="cpu")
        (lp * inp["adv"].to(lp.dtype)).sum().backward()
        out.append(y.grad)
    return out


CHILD = f"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_cpu_stream_stores import gradients
torch.save(gradients(torch.load(sys.argv[2])), sys.argv[3])
print({MARKER!r} + "true")
"""


def _inputs():
    gen = torch.Generator().manual_seed(20261206)
    out = []
    for dtype, V, opts in CASES:
        inp = make_inputs(3, 5, V, gen, dtype=dtype, padding="random", ratio_spread=0.6)
        if opts.get("inplace_backward"):  # the in-place op takes the [B, T, V] logits
            inp["full"] = inp["full"][:, :5].contiguous()
        out.append(inp)
    return out


@pytest.mark.skipif(_extension.CPU_CAPABILITY == "default",
                    reason="the default capability has no non-temporal store: nothing to "
                           "compare")
def test_streamed_gradients_equal_plain_ones(tmp_path):
    inputs = _inputs()
    assert any(not m.all() for m in (i["mask"] for i in inputs)), "no masked row drawn"
    torch.save(inputs, tmp_path / "inputs.pt")
    run_child(CHILD, os.path.dirname(__file__), tmp_path / "inputs.pt", tmp_path / "out.pt",
              env={"PPO_KERNELS_CPU_STREAM_BYTES": "0"},
              what="streaming child")
    streamed = torch.load(tmp_path / "out.pt")
    plain = gradients(inputs)
    assert len(streamed) == len(plain) == 2 * len(CASES)
    for k, (s, p) in enumerate(zip(streamed, plain)):
        dtype, V, opts = CASES[k // 2]
        what = f"{dtype} V {V} {opts} {('ppo_loss', 'token_logprobs')[k % 2]}"
        assert s.dtype == p.dtype and s.shape == p.shape, what
        assert torch.equal(s, p), what
        assert p.abs().sum() > 0, what
