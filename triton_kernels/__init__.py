"""Triton backend of ppo_kernels, installed as ``ppo_kernels.triton_kernels``.

Importing it registers the operators ppo_kernels::triton_token_logprobs_fwd, _bwd,
triton_ppo_loss_fwd, triton_ppo_loss_fwd_inplace, triton_scale_grad_, triton_gae and
triton_score_rollout (schemas: csrc/ops.cpp). The Python launchers below take the same
arguments and are what the ops call; ppo_kernels/_autograd.py adds the fake and autograd
formulas.
"""

from .gae import gae, score_rollout
from .logprobs import token_logprobs_bwd, token_logprobs_fwd
from .library import register
from .ppo_loss import ppo_loss_fwd, ppo_loss_fwd_inplace, scale_grad_

__all__ = ["gae", "ppo_loss_fwd", "ppo_loss_fwd_inplace", "register", "scale_grad_",
           "score_rollout", "token_logprobs_bwd", "token_logprobs_fwd"]
