"""Triton backend of ppo_kernels, installed as ``ppo_kernels.triton_kernels``.

The Python launchers (gae, logprobs, ppo_loss, sampling, distill) and the shared math
(_math). Importing ``ppo_kernels.triton_kernels.library`` registers them as the operators
ppo_kernels::triton_* with the schemas of their C++ twins (csrc/ops.cpp, read from the
compiled extension, which must be loaded); ppo_kernels/_autograd.py adds the fake and
autograd formulas.
"""

from .gae import gae, score_rollout
from .logprobs import token_logprobs_bwd, token_logprobs_fwd
from .ppo_loss import ppo_loss_fwd, ppo_loss_fwd_inplace, scale_grad_

__all__ = ["gae", "ppo_loss_fwd", "ppo_loss_fwd_inplace", "scale_grad_", "score_rollout",
           "token_logprobs_bwd", "token_logprobs_fwd"]
