"""Registers the Triton kernels as torch operators ppo_kernels::triton_*.

Each op has the schema of its C++ twin in csrc/ops.cpp (same argument names, order,
outputs, dtypes and semantics), prefixed with ``triton_``. Only the implementations live
here: ppo_kernels/_autograd.py registers the fake (meta) and autograd formulas of these names
together with the C++ ops. torch.library.triton_op (rather than custom_op) lets
torch.compile see the kernels inside (each launch goes through wrap_triton).

Importing this module defines the ops exactly once per process; register() is idempotent
and returns the op handles.
"""

from typing import Optional

import torch
from torch import Tensor
from torch.library import triton_op

# Functions, not modules: the package namespace binds `gae` to the function (__init__).
from .gae import gae as _gae
from .gae import score_rollout as _score_rollout
from .logprobs import token_logprobs_bwd as _token_logprobs_bwd
from .logprobs import token_logprobs_fwd as _token_logprobs_fwd
from .ppo_loss import ppo_loss_fwd as _ppo_loss_fwd
from .ppo_loss import ppo_loss_fwd_inplace as _ppo_loss_fwd_inplace
from .ppo_loss import scale_grad_ as _scale_grad_
from .sampling import kept_logprobs_bwd_ as _kept_logprobs_bwd_
from .sampling import kept_logprobs_fwd as _kept_logprobs_fwd
from .sampling import sampling_threshold as _sampling_threshold

NAMESPACE = "ppo_kernels"

# name -> schema after the name, copied from csrc/ops.cpp (output names included).
SCHEMAS = {
    "triton_token_logprobs_fwd":
        "(Tensor logits, Tensor tokens, Tensor mask, float temperature, "
        "bool return_entropy, Tensor? temperatures=None) "
        "-> (Tensor logprobs, Tensor entropy, Tensor row_max, Tensor log_sum)",
    "triton_token_logprobs_bwd":
        "(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, "
        "Tensor tokens, Tensor mask, Tensor row_max, Tensor log_sum, Tensor entropy, "
        "float temperature, Tensor? temperatures=None) -> Tensor",
    "triton_ppo_loss_fwd":
        "(Tensor logits, Tensor tokens, Tensor mask, Tensor? old_logprobs, "
        "Tensor advantages, Tensor weights, Tensor? ref_logprobs, Tensor? rollout_is_weights, "
        "Tensor? entropy_weights, float[] scalars, int[] codes, bool compute_grad, "
        "Tensor? temperatures=None) "
        "-> (Tensor loss, Tensor loss_tok, Tensor logprobs, Tensor entropy, Tensor dlogits)",
    "triton_ppo_loss_fwd_inplace":
        "(Tensor(a!) logits, Tensor tokens, Tensor mask, "
        "Tensor? old_logprobs, Tensor advantages, Tensor weights, Tensor? ref_logprobs, "
        "Tensor? rollout_is_weights, Tensor? entropy_weights, float[] scalars, int[] codes, "
        "Tensor? temperatures=None) "
        "-> (Tensor loss, Tensor loss_tok, Tensor logprobs, Tensor entropy)",
    "triton_scale_grad_":
        "(Tensor(a!) grad, Tensor grad_output, Tensor(b!) applied) -> ()",
    "triton_gae":
        "(Tensor rewards, Tensor values, Tensor mask, Tensor? bootstrap_values, "
        "float gamma, float lam, Tensor? lam_per_seq=None, float? value_lam=None) "
        "-> (Tensor advantages, Tensor returns)",
    "triton_score_rollout":
        "(Tensor logits, Tensor tokens, Tensor mask, Tensor ref_logprobs, "
        "Tensor values, Tensor scores, float kl_coef, int kl_estimator, float gamma, "
        "float lam, float temperature, Tensor? lam_per_seq=None, float? value_lam=None, "
        "Tensor? temperatures=None) "
        "-> (Tensor logprobs, Tensor kl, Tensor rewards, Tensor advantages, Tensor returns)",
    "triton_sampling_threshold":
        "(Tensor logits, Tensor mask, float temperature, Tensor? top_k, "
        "Tensor? top_p, Tensor? min_p, Tensor? temperatures=None) -> Tensor",
    "triton_kept_logprobs_fwd":
        "(Tensor logits, Tensor tokens, Tensor mask, float temperature, "
        "Tensor? kept_ids, Tensor? kept_offsets, Tensor? threshold, "
        "Tensor? temperatures=None) -> (Tensor logprobs, "
        "Tensor entropy, Tensor kept_max, Tensor kept_log_sum, Tensor kept_size, "
        "Tensor missing)",
    "triton_kept_logprobs_bwd_":
        "(Tensor grad_logprobs, Tensor? grad_entropy, Tensor logits, "
        "Tensor tokens, Tensor mask, Tensor kept_max, Tensor kept_log_sum, Tensor entropy, "
        "float temperature, Tensor? kept_ids, Tensor? kept_offsets, Tensor? threshold, "
        "Tensor(a!) dlogits, Tensor? temperatures=None) -> ()",
}


def token_logprobs_fwd(logits: Tensor, tokens: Tensor, mask: Tensor, temperature: float,
                       return_entropy: bool, temperatures: Optional[Tensor] = None
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _token_logprobs_fwd(logits, tokens, mask, temperature, return_entropy, temperatures)


def token_logprobs_bwd(grad_logprobs: Tensor, grad_entropy: Optional[Tensor], logits: Tensor,
                       tokens: Tensor, mask: Tensor, row_max: Tensor, log_sum: Tensor,
                       entropy: Tensor, temperature: float,
                       temperatures: Optional[Tensor] = None) -> Tensor:
    return _token_logprobs_bwd(grad_logprobs, grad_entropy, logits, tokens, mask, row_max,
                               log_sum, entropy, temperature, temperatures)


def ppo_loss_fwd(logits: Tensor, tokens: Tensor, mask: Tensor, old_logprobs: Optional[Tensor],
                 advantages: Tensor, weights: Tensor, ref_logprobs: Optional[Tensor],
                 rollout_is_weights: Optional[Tensor], entropy_weights: Optional[Tensor],
                 scalars: list[float], codes: list[int], compute_grad: bool,
                 temperatures: Optional[Tensor] = None
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _ppo_loss_fwd(logits, tokens, mask, old_logprobs, advantages, weights,
                         ref_logprobs, rollout_is_weights, entropy_weights, scalars, codes,
                         compute_grad, temperatures)


def ppo_loss_fwd_inplace(logits: Tensor, tokens: Tensor, mask: Tensor,
                         old_logprobs: Optional[Tensor], advantages: Tensor, weights: Tensor,
                         ref_logprobs: Optional[Tensor], rollout_is_weights: Optional[Tensor],
                         entropy_weights: Optional[Tensor], scalars: list[float],
                         codes: list[int], temperatures: Optional[Tensor] = None
                         ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _ppo_loss_fwd_inplace(logits, tokens, mask, old_logprobs, advantages, weights,
                                 ref_logprobs, rollout_is_weights, entropy_weights, scalars,
                                 codes, temperatures)


def scale_grad_(grad: Tensor, grad_output: Tensor, applied: Tensor) -> None:
    _scale_grad_(grad, grad_output, applied)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, bootstrap_values: Optional[Tensor],
        gamma: float, lam: float, lam_per_seq: Optional[Tensor] = None,
        value_lam: Optional[float] = None) -> tuple[Tensor, Tensor]:
    return _gae(rewards, values, mask, bootstrap_values, gamma, lam, lam_per_seq, value_lam)


def score_rollout(logits: Tensor, tokens: Tensor, mask: Tensor, ref_logprobs: Tensor,
                  values: Tensor, scores: Tensor, kl_coef: float, kl_estimator: int,
                  gamma: float, lam: float, temperature: float,
                  lam_per_seq: Optional[Tensor] = None, value_lam: Optional[float] = None,
                  temperatures: Optional[Tensor] = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _score_rollout(logits, tokens, mask, ref_logprobs, values, scores, kl_coef,
                          kl_estimator, gamma, lam, temperature, lam_per_seq, value_lam,
                          temperatures=temperatures)


def sampling_threshold(logits: Tensor, mask: Tensor, temperature: float,
                       top_k: Optional[Tensor], top_p: Optional[Tensor],
                       min_p: Optional[Tensor], temperatures: Optional[Tensor] = None
                       ) -> Tensor:
    return _sampling_threshold(logits, mask, temperature, top_k, top_p, min_p, temperatures)


def kept_logprobs_fwd(logits: Tensor, tokens: Tensor, mask: Tensor, temperature: float,
                      kept_ids: Optional[Tensor], kept_offsets: Optional[Tensor],
                      threshold: Optional[Tensor], temperatures: Optional[Tensor] = None
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _kept_logprobs_fwd(logits, tokens, mask, temperature, kept_ids, kept_offsets,
                              threshold, temperatures)


def kept_logprobs_bwd_(grad_logprobs: Tensor, grad_entropy: Optional[Tensor], logits: Tensor,
                       tokens: Tensor, mask: Tensor, kept_max: Tensor, kept_log_sum: Tensor,
                       entropy: Tensor, temperature: float, kept_ids: Optional[Tensor],
                       kept_offsets: Optional[Tensor], threshold: Optional[Tensor],
                       dlogits: Tensor, temperatures: Optional[Tensor] = None) -> None:
    _kept_logprobs_bwd_(grad_logprobs, grad_entropy, logits, tokens, mask, kept_max,
                        kept_log_sum, entropy, temperature, kept_ids, kept_offsets, threshold,
                        dlogits, temperatures)


_IMPLS = {
    "triton_token_logprobs_fwd": (token_logprobs_fwd, ()),
    "triton_token_logprobs_bwd": (token_logprobs_bwd, ()),
    "triton_ppo_loss_fwd": (ppo_loss_fwd, ()),
    "triton_ppo_loss_fwd_inplace": (ppo_loss_fwd_inplace, ("logits",)),
    "triton_scale_grad_": (scale_grad_, ("grad", "applied")),
    "triton_gae": (gae, ()),
    "triton_score_rollout": (score_rollout, ()),
    "triton_sampling_threshold": (sampling_threshold, ()),
    "triton_kept_logprobs_fwd": (kept_logprobs_fwd, ()),
    "triton_kept_logprobs_bwd_": (kept_logprobs_bwd_, ("dlogits",)),
}

# top-k distillation (triton_kernels/distill.py; the C++ schema appended to csrc/ops.cpp)
from .distill import distill_fwd as _distill_fwd  # noqa: E402

SCHEMAS["triton_distill_fwd"] = (
    "(Tensor logits, Tensor mask, Tensor offsets, Tensor token_ids, "
    "Tensor teacher_logprobs, Tensor weights, float temperature, float grad_scale, "
    "bool tail, bool compute_grad) -> (Tensor loss, Tensor kl, Tensor student_mass, "
    "Tensor teacher_tail, Tensor dlogits)")


def distill_fwd(logits: Tensor, mask: Tensor, offsets: Tensor, token_ids: Tensor,
                teacher_logprobs: Tensor, weights: Tensor, temperature: float,
                grad_scale: float, tail: bool, compute_grad: bool
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _distill_fwd(logits, mask, offsets, token_ids, teacher_logprobs, weights,
                        temperature, grad_scale, tail, compute_grad)


_IMPLS["triton_distill_fwd"] = (distill_fwd, ())


_registered = {}


def _already_defined(name):
    """True when ppo_kernels::<name> exists in the dispatcher (defined by an earlier
    import of this file under another module name, or by anyone else)."""
    return torch._C._dispatch_has_kernel(f"{NAMESPACE}::{name}") or any(
        s.name == f"{NAMESPACE}::{name}" for s in torch._C._jit_get_all_schemas())


def register():
    """Define every ppo_kernels::triton_* op once; returns {name: OpOverloadPacket}."""
    if not _registered:
        for name, (fn, mutates) in _IMPLS.items():
            if not _already_defined(name):
                triton_op(f"{NAMESPACE}::{name}", mutates_args=mutates,
                          schema=SCHEMAS[name])(fn)
            _registered[name] = getattr(getattr(torch.ops, NAMESPACE), name)
    return dict(_registered)


register()
