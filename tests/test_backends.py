"""Tests of ppo_kernels/_backends.py, how a backend name and the tensors' device pick an
implementation: "auto" is the compiled kernel of the tensors' device, "triton" on CPU
tensors only under the interpreter. (Every backend's results: the backend-parametrised
tests of test_loss*.py and test_advantages.py.)"""

import pytest
import torch

import ppo_kernels as pk

from helpers.backends import HAS_CUDA_DEVICE
from helpers.bad_inputs import base_tlp
from helpers.inputs import make_inputs


def test_auto_backend_is_cpu_for_cpu_tensors(gen):
    """backend="auto" (the default) on CPU tensors is the cpu kernels: the same bits."""
    inp = make_inputs(3, 5, 37, gen)
    a = pk.token_logprobs(inp["full"][:, :5], inp["tokens"], inp["mask"])
    b = pk.token_logprobs(inp["full"][:, :5], inp["tokens"], inp["mask"], backend="cpu")
    assert torch.equal(a, b)


@pytest.mark.skipif(HAS_CUDA_DEVICE, reason="with a GPU, triton runs there")
def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    """backend="triton" on CPU tensors without TRITON_INTERPRET (and no GPU): a ValueError
    naming backend."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    d = base_tlp()
    d["backend"] = "triton"
    with pytest.raises(ValueError, match="backend"):
        pk.token_logprobs(**d)
