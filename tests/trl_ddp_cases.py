"""The two-process case of tests/test_integrations_trl.py: TRL's GRPOTrainer and
FusedGRPOTrainer trained under accelerate's DDP on CPU (gloo), 2 processes:

    python tests/trl_ddp_cases.py RANK PORT OUT_DIR   (helpers/ranks.py)

For gradient_checkpointing False (transformers then wraps the model in DDP with
find_unused_parameters=True, where a head used after the model's forward fails with
"Expected to mark a variable ready only once") and True (find_unused_parameters=False),
each trainer runs 2 SGD steps from the same tiny model and seed. Each rank writes
OUT_DIR/rank<r>.json: {"gc=<bool>": {"stock": ..., "fused": ...}} with the logs (timings
dropped), the final parameters' checksum vector and the wrapper seen, or an error message.
"""

import os
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from helpers.ranks import case, rank_main  # noqa: E402


def run(cls, out_dir, path, gc, **kw):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from test_integrations_trl import DATA, reward_len, tokenizer
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=out_dir, report_to="none", per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, use_cpu=True, bf16=False,
                      seed=0, save_strategy="no", logging_steps=1, max_steps=2,
                      learning_rate=0.5, optim="sgd", gradient_checkpointing=gc,
                      ddp_backend="gloo", loss_type="dapo", beta=0.05, **kw)
    tr = cls(model=path, reward_funcs=reward_len, args=args, train_dataset=DATA,
             processing_class=tokenizer())
    tr.train()
    wrapped = tr.model_wrapped
    logs = [{k: v for k, v in e.items() if "time" not in k and "per_second" not in k
             and k != "train_runtime"} for e in tr.state.log_history]
    params = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
    return {"logs": logs, "params": params.tolist()[:400] + [float(params.sum())],
            "ddp": isinstance(wrapped, DDP),
            "find_unused": bool(getattr(wrapped, "find_unused_parameters", None)),
            "processes": tr.accelerator.num_processes}


def save_model(r):
    """The tiny model, saved where TRL loads the reference model from (before the
    distributed environment is set)."""
    from test_integrations_trl import tiny_model
    path = os.path.join(r.out, f"model{r.rank}")
    tiny_model().save_pretrained(path)
    return path


def train(r, name, gc):
    from trl import GRPOTrainer

    from ppo_kernels.integrations.trl import FusedGRPOTrainer
    cls = {"stock": GRPOTrainer, "fused": FusedGRPOTrainer}[name]
    try:
        return run(cls, os.path.join(r.out, f"{name}{gc}{r.rank}"), r.state, gc)
    except Exception as e:  # recorded beside the other trainer's result, the test fails on it
        return f"error: {type(e).__name__}: {e} {traceback.format_exc()[-2500:]}"


def cases(r):
    return [case(f"gc={gc}", lambda gc=gc: {name: train(r, name, gc)
                                           for name in ("stock", "fused")})
            for gc in (False, True)]


if __name__ == "__main__":
    # accelerate makes the process group itself, from the environment rank_main sets
    rank_main(cases, prepare=save_model, group=False)
