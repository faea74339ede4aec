"""Drop-in integrations of the fused loss into RL trainers people already run.

Each lives in its own module and imports its trainer package only when imported itself:
``ppo_kernels.integrations.trl`` (TRL's GRPOTrainer, docs/TRL.md) and
``ppo_kernels.integrations.verl`` (verl's policy-loss registry and fused log-prob hook,
docs/VERL.md).
"""
