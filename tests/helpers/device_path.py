"""The device path of ppo_loss (the [B, T] work of a call as Triton launches, which runs for
CUDA tensors on the triton and cuda backends: ppo_kernels/_backends.device_eager) forced
on, so that the Triton interpreter's CPU tensors take it too, and the helpers of the tests
that compare it with the eager formulas (test_triton_weights.py, test_seq_loss.py,
test_triton_metrics.py, test_launch_counts.py)."""

import ppo_kernels as pk
from ppo_kernels import _backends, _checks


def force(monkeypatch):
    """Puts calls on the triton and cuda backends on the device path, with no host reads of
    tensor values (as for CUDA tensors), for the rest of the test."""
    monkeypatch.setattr(_checks, "host_readable", lambda x: False)
    monkeypatch.setattr(_backends, "device_eager", lambda be, t: be.name in ("triton", "cuda"))


def spy(monkeypatch, module, name):
    """Wraps module.name so that each call is recorded; returns the list of calls."""
    calls, real = [], getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


def eager_and_device(monkeypatch, module, name, logits, *args, **kw):
    """ppo_loss(logits.clone(), *args, **kw) forward and backward twice: with the eager
    formulas on any device (device_eager off), then on the device path with module.name
    spied on. Returns ((loss, logits grad, metrics) eager, the same on the device path,
    the spy's calls)."""
    out = []
    with monkeypatch.context() as eager:
        eager.setattr(_backends, "device_eager", lambda be, t: False)
        out.append(_run(logits, *args, **kw))
    calls = spy(monkeypatch, module, name)
    force(monkeypatch)
    out.append(_run(logits, *args, **kw))
    return out[0], out[1], calls


def _run(logits, *args, **kw):
    x = logits.detach().clone().requires_grad_()
    loss, metrics = pk.ppo_loss(x, *args, **kw)
    loss.backward()
    return loss.detach(), x.grad, dict(metrics)
