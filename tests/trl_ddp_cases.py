"""The two-process case of tests/test_integrations_trl.py: TRL's GRPOTrainer and
FusedGRPOTrainer trained under accelerate's DDP on CPU (gloo), 2 processes:

    python tests/trl_ddp_cases.py RANK PORT OUT_DIR

For gradient_checkpointing False (transformers then wraps the model in DDP with
find_unused_parameters=True, where a head used after the model's forward fails with
"Expected to mark a variable ready only once") and True (find_unused_parameters=False),
each trainer runs 2 SGD steps from the same tiny model and seed. Each rank writes
OUT_DIR/rank<r>.json: {"gc=<bool>": {"stock": ..., "fused": ...}} with the logs (timings
dropped), the final parameters' checksum vector and the wrapper seen, or an error message.
"""

import json
import os
import sys
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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


def worker(rank, port, out):
    from test_integrations_trl import tiny_model
    path = os.path.join(out, f"model{rank}")  # a path: TRL loads the reference model from it
    tiny_model().save_pretrained(path)  # (before the distributed environment is set)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      OMP_NUM_THREADS="1")
    from trl import GRPOTrainer

    from ppo_kernels.integrations.trl import FusedGRPOTrainer
    res = {}
    for gc in (False, True):
        case = {}
        for name, cls in (("stock", GRPOTrainer), ("fused", FusedGRPOTrainer)):
            try:
                case[name] = run(cls, os.path.join(out, f"{name}{gc}{rank}"), path, gc)
            except Exception as e:  # recorded, the test fails on it
                case[name] = f"error: {type(e).__name__}: {e} {traceback.format_exc()[-2500:]}"
        res[f"gc={gc}"] = case
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    from rank_exit import run_then_exit

    run_then_exit(worker, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
