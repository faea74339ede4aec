"""GPU device check of batch invariance (DESIGN.md; tests/test_batch_invariance.py pins it on
every backend at small shapes): a row's logp, entropy, loss_tok and dlogits from the fused
ppo_loss op are bitwise the same alone (its own [1, 2, V] tensor), inside a batch of 4096
rows and in a permuted batch, for bf16 / float32 logits at V = 32000 and 50257; on CUDA
with the vocabulary split forced, never and left to the row count, and the cluster path
forced (4 blocks a row: the fused, split and cluster paths bitwise equal), and on Triton.

    python tests/gpu/batch_invariance.py [--device cpu --small] [--budget-s S]

(tests/gpu/_harness.py: the CHECK lines, the budget, the CPU dry run.)
"""

from __future__ import annotations

import sys

import torch

from _harness import check, main, report, set_cuda_path as set_path, slot_args


# The CUDA ops' paths (csrc/cuda/row_kernels.cuh, plan_rows): their knobs.
PATHS = {"fused": {"PPO_CUDA_SPLIT": "1", "PPO_CUDA_CLUSTER": "1"},
         "split": {"PPO_CUDA_SPLIT": "2", "PPO_CUDA_CLUSTER": "1"},
         "cluster": {"PPO_CUDA_SPLIT": "1", "PPO_CUDA_CLUSTER": "4"}}


@check
def batch_invariance(ctx):
    """A row's logp, H, loss_tok and dlogits: bitwise the same alone (own [1, 2, V] tensor),
    inside a batch of many rows and in a permuted batch; CUDA with the split path forced,
    never and auto; Triton."""
    nrows = 16 if ctx.small else 4096  # (small: the interpreter takes ~1 s a row)
    cases = [(torch.bfloat16, 32000), (torch.float32, 32000), (torch.bfloat16, 50257)]
    if ctx.small:
        cases = [(torch.bfloat16, 1000), (torch.float32, 257)]
    g = torch.Generator().manual_seed(5)
    for dt, V in cases:
        n = nrows if V % 8 == 0 else nrows // 8
        x = (torch.randn(1, n + 1, V, generator=g) * 2).to(dt).to(ctx.dev)
        tok = torch.randint(0, V, (1, n), generator=g).to(ctx.dev)
        acc = torch.float32
        old = (torch.randn(1, n, generator=g) * 0.1 - 9).to(acc).to(ctx.dev)
        adv = torch.randn(1, n, generator=g).to(acc).to(ctx.dev)
        ref = (torch.randn(1, n, generator=g) * 0.1 - 9).to(acc).to(ctx.dev)
        w = torch.ones(1, n, dtype=acc, device=ctx.dev)  # same normaliser for every layout
        mask = torch.ones(1, n, dtype=torch.bool, device=ctx.dev)
        pick = [0, 1, n // 2, n - 1]
        perm = torch.randperm(n, generator=g).to(ctx.dev)

        def run(be, xx, tk, o, a, r, ww, mm):
            op = ctx.op(be, "ppo_loss_fwd")
            # schema: ..., rollout_is_weights, entropy_weights, scalars, codes, compute_grad
            _, ltok, lp, ent, dl = op(xx, tk, mm, o, a, ww, r, None, None,
                                      *slot_args(0.2, 0.28, 3.0, 0.05, 2, 0.01, 0.9, 1.0, 0, 1.0,
                                                 1.05, False), True)
            return lp, ent, ltok, dl

        envs = [("auto", {}), ("split=1", PATHS["fused"]), ("split=2", PATHS["split"]),
                ("cluster=4", PATHS["cluster"])] if ctx.gpu else [("", {})]
        for be in ctx.kern:
            for ename, env in (envs if be in ("cuda",) else [("", {})]):
                set_path(env)
                try:
                    full = run(be, x, tok, old, adv, ref, w, mask)
                    inv = torch.argsort(perm)
                    xp = torch.cat([x[:, :n][:, perm], x[:, n:]], 1)
                    permd = run(be, xp, tok[:, perm], old[:, perm], adv[:, perm], ref[:, perm],
                                w, mask)
                    bad = []
                    for k, name in enumerate(("logp", "H", "loss_tok")):
                        if not torch.equal(permd[k][:, inv], full[k]):
                            bad.append(f"permuted {name}")
                    if not torch.equal(permd[3][:, :n][:, inv], full[3][:, :n]):
                        bad.append("permuted dlogits")
                    for i in pick:
                        sl = slice(i, i + 1)
                        alone = run(be, x[:, i:i + 2].clone(), tok[:, sl], old[:, sl], adv[:, sl],
                                    ref[:, sl], w[:, sl], mask[:, sl])
                        for k, name in enumerate(("logp", "H", "loss_tok")):
                            if not torch.equal(alone[k], full[k][:, sl]):
                                bad.append(f"row {i} alone {name}")
                        if not torch.equal(alone[3][:, :1], full[3][:, sl]):
                            bad.append(f"row {i} alone dlogits")
                finally:
                    set_path({})
                label = f"invariance[{be}{',' + ename if ename else ''} {str(dt)[6:]} V={V}]"
                report(label, "ok" if not bad else "FAIL",
                       f"{n} rows" + ("" if not bad else ": " + ", ".join(bad[:4])))
        # the CUDA fused, split and cluster paths against each other (same bits by design)
        if ctx.gpu:
            res = {}
            for path, env in PATHS.items():
                set_path(env)
                res[path] = run("cuda", x, tok, old, adv, ref, w, mask)
            set_path({})
            for path in ("split", "cluster"):
                same = all(torch.equal(a, b) for a, b in zip(res["fused"], res[path]))
                report(f"invariance[cuda fused=={path} {str(dt)[6:]} V={V}]",
                       "ok" if same else "FAIL", "" if same else f"fused and {path} paths differ")
        del x


CHECKS = [batch_invariance]

if __name__ == "__main__":
    sys.exit(main(CHECKS, __doc__))
