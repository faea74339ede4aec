"""The backends the public ops dispatch through: the kernel ops of the compiled extension
(cpu, cuda) or of Triton, behind one KernelBackend, and the eager composite (torch).
get_backend picks one for a backend name and the tensors' device."""

from __future__ import annotations

import importlib
import os
import warnings

import torch

from . import _torch_impl
from ._autograd import FusedLoss, fused_loss, not_traceable, register, wants_grad
from ._checks import detached, split_temperature
from ._extension import HAS_CPU, HAS_CUDA, HAS_SCHEMAS, LOAD_ERROR, not_built_hint
from .spec import KL_ESTIMATORS


def recorded(*tensors):
    """Whether a kernel op call goes through the op's autograd kernel: a gradient is wanted,
    or torch.jit.trace / torch.compile records the call. Else (eager, no gradient) the
    backends call the op below autograd, straight to the device kernel: the autograd
    kernel registered from Python (_autograd.register) would only redispatch, at tens of
    microseconds a call."""
    return wants_grad(*tensors) or torch.jit.is_tracing() or torch.compiler.is_compiling()


def call_op(op, like, *args, **kwargs):
    """op(*args, **kwargs) for a kernel op whose differentiable input is like: through its
    autograd kernel where the call is recorded (recorded(like)), else below autograd,
    straight to the device kernel."""
    if recorded(like):
        return op(*args, **kwargs)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args, **kwargs)


class KernelBackend:
    """A backend made of the compiled ops (prefix "") or the Triton ones ("triton_")."""

    is_kernel = True

    def __init__(self, name, prefix):
        self.name, self.prefix = name, prefix

    def op(self, name):
        """torch.ops.ppo_kernels.<prefix><name>: this backend's kernel op ``name``."""
        return getattr(torch.ops.ppo_kernels, self.prefix + name)

    def has_op(self, name):
        """Whether this build has the kernel op ``name`` for this backend."""
        return hasattr(torch.ops.ppo_kernels, self.prefix + name)

    def token_logprobs(self, logits, tokens, mask, temperature, return_entropy):
        """temperature: a number or the per-row [B, T] tensor (the ops' `temperatures`)."""
        t, temps = split_temperature(temperature)
        logp, ent, _, _ = call_op(self.op("token_logprobs_fwd"), logits, logits, tokens, mask,
                                  t, return_entropy, temperatures=temps)
        return logp, (ent if return_entropy else None)

    def ppo_loss(self, logits, kin, spec):
        """The fused single pass of a token-level policy loss (the two-phase path is
        loss.two_phase's to choose): (loss, loss_tok, logp, ent), all but loss detached.
        kin: the call's loss.KernelInputs (the per-token tensors in the kernels' layout,
        the per-row temperature or None for spec.temperature)."""
        tensors, rows = kin.op_tensors(), kin.row_tensors()
        weights, w_ent = kin.weights, kin.w_ent
        scalars, codes = spec.kernel_args(logits.dtype)
        # under torch.jit.trace always: its check re-runs the call under no_grad, and the
        # recorded graph must not depend on that (the replay's autograd uses the gradient)
        tracing = torch.jit.is_tracing()
        if tracing and spec.inplace_backward and logits.requires_grad:
            raise not_traceable("inplace_backward=True")
        need_grad = wants_grad(logits) or tracing
        if spec.inplace_backward and need_grad and not tracing:
            loss, loss_tok, logp, ent = FusedLoss.apply(
                logits, self.op("ppo_loss_fwd_inplace"), tensors, scalars, codes, self.prefix,
                rows, True)
        elif need_grad and not tracing and not torch.compiler.is_compiling():
            loss, loss_tok, logp, ent = fused_loss(self.prefix, logits, tensors, scalars, codes,
                                                   rows)
        else:  # (need_grad: traced; with no gradient in eager mode below autograd, call_op)
            loss, loss_tok, logp, ent, _ = call_op(self.op("ppo_loss_fwd"), logits, logits,
                                                   *tensors, scalars, codes, need_grad, *rows)
        if w_ent is not None and spec.entropy_coef != 0.0:
            # the kernel sums w * (... - entropy_coef H); the entropy term's own weights
            # are w_ent (its gradient already carries them)
            loss = loss + spec.entropy_coef * ((weights - w_ent) * ent.detach()).sum()
        return loss, detached(loss_tok), detached(logp), detached(ent)

    def gae(self, rewards, values, mask, bootstrap_values, gamma, lam, lam_per_seq=None,
            value_lam=None):
        return self.op("gae")(rewards, values, mask, bootstrap_values, gamma, lam, lam_per_seq,
                              value_lam)

    def score_rollout(self, logits, tokens, mask, ref, values, scores, kl_coef, kl_estimator_id,
                      gamma, lam, temperature, lam_per_seq=None, value_lam=None):
        """temperature: a number or the per-row [B, T] tensor (the op's `temperatures`)."""
        t, temps = split_temperature(temperature)
        return self.op("score_rollout")(logits, tokens, mask, ref, values, scores, kl_coef,
                                        kl_estimator_id, gamma, lam, t, lam_per_seq, value_lam,
                                        temperatures=temps)


class TorchBackend:
    """The eager composite of _torch_impl, behind the same methods."""

    name = "torch"
    is_kernel = False

    def token_logprobs(self, logits, tokens, mask, temperature, return_entropy):
        return _torch_impl.token_logprobs(logits, tokens, mask, temperature, return_entropy)

    def ppo_loss(self, logits, kin, spec):
        loss, loss_tok, logp, ent = _torch_impl.ppo_loss(logits, kin, spec)
        return loss, loss_tok.detach(), logp.detach(), ent.detach()

    def gae(self, rewards, values, mask, bootstrap_values, gamma, lam, lam_per_seq=None,
            value_lam=None):
        return _torch_impl.gae(rewards, values, mask, bootstrap_values, gamma, lam, lam_per_seq,
                               value_lam)

    def score_rollout(self, logits, tokens, mask, ref, values, scores, kl_coef, kl_estimator_id,
                      gamma, lam, temperature, lam_per_seq=None, value_lam=None):
        return _torch_impl.score_rollout(logits, tokens, mask, ref, values, scores, kl_coef,
                                         KL_ESTIMATORS[kl_estimator_id], gamma, lam, temperature,
                                         lam_per_seq, value_lam)


def triton_importable():
    """Whether the Triton ops can run here (a CUDA device, or TRITON_INTERPRET=1) and
    import; registers their fakes and autograd on the first success."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        importlib.import_module("ppo_kernels.triton_kernels.library")
    except ImportError:
        return False
    register("triton_")
    return True


def _outside_functorch(name):
    """The kernel ops have autograd formulas but no functorch rules: under torch.func.grad /
    vjp / jacrev / vmap they would fail inside PyTorch with a message about setup_context."""
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            f"backend: {name!r} does not run under torch.func transforms (grad, vjp, jacrev, "
            f"vmap): the kernel ops have no functorch rules; use backend='torch' (the eager "
            f"composite, which they differentiate exactly)")


_WARNED = set()


def _warn_eager_fallback(dev):
    """One warning per device type when backend="auto" runs the eager composite because no
    kernel backend is there: a silent fallback is about 10x slower."""
    if dev in _WARNED:
        return
    _WARNED.add(dev)
    # (without the compiled extension the Triton ops have no schemas either: build it)
    why = (not_built_hint() if dev != "cuda" or not HAS_SCHEMAS else
           "the extension has no CUDA kernels here and triton is not importable "
           "(pip install triton, or build with a CUDA toolkit)")
    warnings.warn(f"ppo_kernels: backend='auto' runs the eager PyTorch composite on {dev} "
                  f"tensors (correct, but about 10x slower than the kernels): {why}. "
                  f"backend='torch' asks for the composite without this warning.",
                  RuntimeWarning, stacklevel=3)


# one object per backend (they hold no state): get_backend runs on every call
_KERNEL_BACKENDS = {name: KernelBackend(name, prefix)
                    for name, prefix in (("cpu", ""), ("cuda", ""), ("triton", "triton_"))}
_TORCH_BACKEND = TorchBackend()


def device_eager(be, t):
    """Whether a call's [B, T] work may run as the Triton launches of a CUDA device
    (triton_kernels/metrics.py, weights.py, seq_loss.py): the triton or cuda backend, t on
    a CUDA device, eager mode (a compiled graph fuses the eager formulas itself), triton
    importable."""
    return (be.name in ("triton", "cuda") and t.is_cuda and not torch.compiler.is_compiling()
            and triton_importable())


def get_backend(backend, device):
    """The backend object for `backend` and the tensors' device, or a ValueError (a
    NotImplementedError for a kernel backend under a torch.func transform)."""
    dev = device.type
    if backend == "auto":
        if dev == "cuda":
            backend = "cuda" if HAS_CUDA else ("triton" if triton_importable() else "torch")
        else:
            backend = "cpu" if HAS_CPU else "torch"
        if backend == "torch":
            _warn_eager_fallback(dev)
    if backend == "torch":
        return _TORCH_BACKEND
    if backend in ("cpu", "cuda", "triton"):
        _outside_functorch(backend)
    if backend == "cpu":
        if not HAS_CPU:
            raise ValueError(f"backend: 'cpu' was asked for but the C++ extension is not built "
                             f"({LOAD_ERROR}); build with `pip install -e . "
                             f"--no-build-isolation` or use backend='torch'")
        if dev != "cpu":
            raise ValueError(f"backend: 'cpu' needs CPU tensors, got tensors on {device}")
        return _KERNEL_BACKENDS["cpu"]
    if backend == "cuda":
        if not HAS_CUDA:
            raise ValueError("backend: 'cuda' was asked for but the extension was built "
                             "without CUDA; use backend='triton' or 'torch'")
        if dev != "cuda":
            raise ValueError(f"backend: 'cuda' needs CUDA tensors, got tensors on {device}")
        return _KERNEL_BACKENDS["cuda"]
    if backend == "triton":
        if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("backend: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for "
                             f"the interpreter), got tensors on {device}")
        if not triton_importable():
            raise ValueError("backend: 'triton' was asked for but triton is not importable")
        return _KERNEL_BACKENDS["triton"]
    raise ValueError(f"backend: expected one of ['auto', 'cpu', 'cuda', 'triton', 'torch'], "
                     f"got {backend!r}")
