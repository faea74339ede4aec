"""ppo-kernels: fused PPO / GRPO loss kernels for LLM RLHF, straight from token logits.

    import ppo_kernels as pk
    loss, metrics = pk.ppo_loss(logits, tokens, old_logprobs, advantages, response_mask)

Backends: "cpu" (C++, at::vec + at::parallel_for), "cuda", "triton", "torch" (eager
composite); "auto" picks the compiled kernel for the tensors' device. The numpy float64
oracle is ppo_kernels.reference. See DESIGN.md for the math and semantics.
"""

from ._extension import build_info, empty_cache
from .advantages import Rollout, gae, kl_penalized_rewards, score_rollout, whiten
from .from_hidden import (ppo_loss_from_hidden, score_rollout_from_hidden,
                          token_logprobs_from_hidden)
from .lm_head import forward_redirect
from .loss import ppo_loss, token_logprobs, value_loss
from .loss_metrics import LossMetrics
from .sampling import SamplingMask
from .spec import LossSpec
from .distill import SparseLogprobs
from .distill_api import distill_loss
from .distill_hidden import distill_loss_from_hidden
from . import distributed  # noqa: E402  (pk.distributed.reduce_metrics)

__all__ = ["token_logprobs", "ppo_loss", "value_loss", "ppo_loss_from_hidden",
           "token_logprobs_from_hidden", "score_rollout_from_hidden", "gae",
           "kl_penalized_rewards", "whiten", "score_rollout", "Rollout", "LossSpec",
           "forward_redirect", "build_info", "empty_cache", "SamplingMask", "SparseLogprobs",
           "distill_loss", "distill_loss_from_hidden", "LossMetrics"]
__version__ = "0.1.0"
