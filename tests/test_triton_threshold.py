"""The re-derived kept sets' threshold on the device (triton_kernels/threshold.py: a radix
select over the logits' bit patterns) against the CPU op ppo_kernels::sampling_threshold
(csrc/cpu/sampling.cpp: a heap, nth_element and a histogram-sized sort), bit for bit, on a CUDA
device where one is present, else under the Triton interpreter: every logits dtype (the
key widths 16, 32 and 64), each rule alone and all together, ties (integer logits, so a
top-k or top-p boundary falls inside a group of equal values), banned -inf entries, +0
and -0 in one row, a row of -inf only, V = 1, rules that are off (k >= V, p = 1,
min_p = 0), a per-row temperature, masked rows and [B, T + 1, V] logits; with the digits
of the GPU (4 bits) and of the interpreter (8 bits). The kept sets'
agreement with vLLM's sampler is tests/test_sampling.py's (through every backend)."""

import pytest
import torch

import ppo_kernels as pk
from ppo_kernels._backends import get_backend
from ppo_kernels.triton_kernels import threshold

from helpers import device_path
from helpers.backends import TRITON_DEVICE as DEV, triton_ops

pytestmark = triton_ops

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _row_params(B, T, V, gen):
    """top_k (int64, some >= V: off), top_p (float64, some 1: off) and min_p (float64,
    some 0: off), [B, T]."""
    top_k = torch.randint(1, V + 3, (B, T), generator=gen)
    top_p = torch.rand(B, T, generator=gen, dtype=torch.float64).clamp(0.02, 1.0)
    top_p[0, 0] = 1.0
    min_p = torch.rand(B, T, generator=gen, dtype=torch.float64) * 0.3
    min_p[0, -1] = 0.0
    return top_k, top_p, min_p


def _logits(B, T, V, gen, dtype, ties):
    x = torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * 3
    if ties:
        x = x.round()
    if V > 3:
        x[0, 1, :3] = torch.tensor([0.0, -0.0, float("-inf")], dtype=torch.float64)
        x[1, 0, ::3] = float("-inf")
    x[1, 1] = float("-inf")  # nothing finite: the max is not finite, keep all
    return x.to(dtype)


def _both(x, mask, temperature, k, p, mp, temps=None):
    get_backend("triton", torch.device(DEV))
    got = threshold.sampling_threshold(
        *(t if t is None else t.to(DEV) for t in (x, mask)), temperature,
        *(t if t is None else t.to(DEV) for t in (k, p, mp, temps)))
    get_backend("cpu", torch.device("cpu"))
    want = torch.ops.ppo_kernels.sampling_threshold(x, mask, temperature, k, p, mp, temps)
    return got.cpu(), want


@pytest.fixture(params=[4, 8], ids=["radix4", "radix8"])
def radix(request, monkeypatch):
    """The digit width: 4 bits (the GPU's), 8 (the interpreter's)."""
    monkeypatch.setattr(threshold, "RADIX_BITS", request.param)
    return request.param


# the GPU's 4-bit digits on its dtypes (16- and 32-bit keys); every dtype with the
# interpreter's 8-bit digits
CASES = [(4, torch.bfloat16), (4, torch.float32), *((8, d) for d in DTYPES)]


@pytest.mark.parametrize("bits,dtype", CASES, ids=[f"radix{b}-{str(d)[6:]}" for b, d in CASES])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_threshold_equals_the_cpu_op(bits, dtype, ties, monkeypatch):
    monkeypatch.setattr(threshold, "RADIX_BITS", bits)
    radix = bits
    gen = torch.Generator().manual_seed(11 + 2 * DTYPES.index(dtype) + ties + 100 * radix)
    B, T = 2, 3
    seen_cut = 0
    for V in (1, 7, 150):
        x = _logits(B, T, V, gen, dtype, ties)
        mask = torch.rand(B, T, generator=gen) > 0.15
        mask[1, 1] = True
        k, p, mp = _row_params(B, T, V, gen)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        temps = (0.3 + 1.4 * torch.rand(B, T, generator=gen)).to(acc)
        for rules, t in (((k, None, None), None), ((None, p, None), None),
                         ((None, None, mp), None), ((k, p, mp), None), ((k, p, mp), temps),
                         ((None, p, mp), temps), ((None, None, None), None)):
            got, want = _both(x, mask, 0.7, *rules, t)
            assert torch.equal(got, want), (V, [r is not None for r in rules], t)
            assert (got[~mask] == float("-inf")).all()
            seen_cut += int((got > float("-inf")).sum())
    assert seen_cut > 30  # a threshold in many rows


def test_threshold_of_one_row_by_hand(radix):
    """A row read by hand: x = [3, 1, 1, 0, -inf], temperature 1. top-k 2 keeps {3, 1, 1}
    (ties with the 2nd); top-p 0.8: mass(S) = e^3 + 2 e + 1, the mass above 1 is e^3
    < 0.8 mass(S), above 0 it is e^3 + 2 e > 0.8 mass(S): threshold 1; min-p 0.2 keeps
    exp(x - 3) >= 0.2: {3} (exp(-2) = 0.135)."""
    x = torch.tensor([[[3.0, 1.0, 1.0, 0.0, float("-inf")]] * 2])
    mask = torch.ones(1, 2, dtype=torch.bool)

    def full(v, dt):
        return torch.full((1, 2), v, dtype=dt)

    for rules, want in (((full(2, torch.int64), None, None), 1.0),
                        ((None, full(0.8, torch.float64), None), 1.0),
                        ((None, None, full(0.2, torch.float64)), 3.0),
                        ((full(5, torch.int64), full(1.0, torch.float64),
                          full(0.0, torch.float64)), float("-inf"))):
        got, cpu = _both(x, mask, 1.0, *rules)
        assert got.tolist() == [[want, want]] == cpu.tolist(), rules


def test_threshold_rejects_parameters_of_the_wrong_dtype():
    x = torch.randn(1, 2, 5)
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="top_k: expected int64"):
        threshold.sampling_threshold(x.to(DEV), mask.to(DEV), 1.0,
                                     torch.full((1, 2), 2.0, device=DEV), None, None)
    with pytest.raises(ValueError, match="top_p: expected float64"):
        threshold.sampling_threshold(x.to(DEV), mask.to(DEV), 1.0, None,
                                     torch.full((1, 2), 0.5, device=DEV), None)


def test_device_path_derives_the_threshold_in_one_launch(monkeypatch):
    """On the device path (a CUDA device, eager: _backends.device_eager, forced here) the
    kept-set ops take the threshold from this kernel, on the cuda backend too
    (kept_rows.threshold_op); token_logprobs equals its value through the op."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 40, generator=gen).to(DEV)
    tokens = torch.randint(0, 40, (2, 4), generator=gen).to(DEV)
    kw = dict(top_k=9, top_p=0.7, min_p=0.05, return_entropy=True, backend="triton")
    op_path = pk.token_logprobs(x, tokens, **kw)
    calls = device_path.spy(monkeypatch, threshold, "sampling_threshold")
    device_path.force(monkeypatch)
    dev_path = pk.token_logprobs(x, tokens, **kw)
    assert len(calls) == 1
    for a, b in zip(op_path, dev_path):
        assert torch.equal(a, b)
