"""My PPO / GRPO configuration of ppo_kernels, checked against its float64 reference.

Copy this file into your CI's tests and put your own options in CONFIG
(docs/TESTING_YOUR_CONFIG.md). Runs with: pytest test_my_config.py
"""

import pytest
import torch

from ppo_kernels import testing

# the ppo_loss keywords of my trainer
CONFIG = dict(policy_loss="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, kl_coef=0.05,
              kl_estimator="k3", entropy_coef=0.01, loss_agg_mode="seq-mean-token-mean")


@pytest.mark.parametrize("kind", testing.BATCH_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(kind, dtype):
    testing.assert_matches_reference(CONFIG, backend="cpu", dtype=dtype, kind=kind)


def test_gradient():
    testing.gradcheck(CONFIG, backend="cpu")
