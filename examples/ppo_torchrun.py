#!/usr/bin/env python
"""The PPO demo (ppo_demo.py) trained on several processes: data parallel x tensor-parallel
vocabulary, on the CPU with the gloo backend, with the same learning curve as one process.

    torchrun --nproc-per-node 2 examples/ppo_torchrun.py --dp 1 --tp 2   # vocabulary split
    torchrun --nproc-per-node 2 examples/ppo_torchrun.py --dp 2 --tp 1   # batch split
    torchrun --nproc-per-node 4 examples/ppo_torchrun.py --dp 2 --tp 2   # both

    # compare with one process, iteration by iteration:
    python examples/ppo_demo.py --json out/one.json
    torchrun --nproc-per-node 2 examples/ppo_torchrun.py --dp 2 --tp 1 --compare out/one.json

Same model, hyper-parameters, seeds and loop as ppo_demo.py (this file only supplies a
``Parallel`` subclass of the demo's ``Local`` strategy). The ranks form a dp x tp grid,
rank = dp_rank * tp + tp_rank, with a TP group per data-parallel replica and a DP group
per vocabulary shard. Every rank holds the whole (tiny) model:

* sampling: every rank pre-trains the same model from the same seed (then rank 0's
  weights are broadcast, to be safe) and samples the *whole* rollout with the same
  generator, so the tokens are those of the single-process run;
* data parallel (--dp): each DP rank scores and trains on its contiguous block of the
  rollout's sequences. The advantages are whitened with statistics all-reduced over the DP
  group; each minibatch is the single-process run's minibatch (same random order), of
  which a rank takes the sequences it holds, with ``global_num_tokens=`` the all-reduced
  count (the value loss is weighted by the same count), so each rank's loss is its exact
  share; the gradients are then summed with one all-reduce, and
  ``pk.distributed.reduce_metrics`` combines the metrics;
* tensor-parallel vocabulary (--tp): the LM head is tied to the embedding; each TP rank
  hands ``pk.score_rollout_from_hidden`` / ``pk.ppo_loss_from_hidden`` its contiguous rows
  [V_r, H] of that weight (``tp_group=``, ``vocab_start=``): the log-probs, entropy and
  loss are the whole vocabulary's on every rank and the gradient of the hidden states is
  already summed over the group, so everything below the head gets the same gradient on
  every TP rank. The head's rows are a separate leaf; their gradient (this shard's dW) is
  summed into the full [V, H] with an all-reduce over the TP group and added to the tied
  parameter's (embedding) gradient;

so every rank then takes the identical optimiser step (checked after every iteration:
the replicas must stay bit-identical). Rank 0 prints the table, writes --json / --out and,
with --compare, the largest difference to a single-process run's history.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ppo_demo as demo  # noqa: E402

# the columns compared with --compare (the curve: reward, KL and the losses, and the rest)
CURVE_KEYS = ("reward", "kl_ref", "pg_loss", "v_loss", "clip_frac", "entropy", "approx_kl",
              "vf_clip_frac", "grammatical", "resp_len")


class Parallel(demo.Local):
    """The demo's ``Local`` strategy for a dp x tp grid of gloo ranks."""

    def __init__(self, dp: int, tp: int, vocab_size: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if dp * tp != world:
            raise SystemExit(f"--dp {dp} x --tp {tp} = {dp * tp} ranks, but torchrun started "
                             f"{world} (--nproc-per-node)")
        if tp > vocab_size:
            raise SystemExit(f"--tp {tp}: more shards than the {vocab_size} vocabulary rows")
        self.dp, self.tp = dp, tp
        self.dp_rank, self.tp_rank = divmod(rank, tp)
        # every rank creates every group, in the same order (torch.distributed's rule)
        self.tp_group = self.dp_group = None
        for d in range(dp):
            g = dist.new_group([d * tp + t for t in range(tp)])
            if d == self.dp_rank:
                self.tp_group = g
        for t in range(tp):
            g = dist.new_group([d * tp + t for d in range(dp)])
            if t == self.tp_rank:
                self.dp_group = g
        # this rank's contiguous rows of the LM head (the first V % tp shards get one more)
        sizes = [vocab_size // tp + (i < vocab_size % tp) for i in range(tp)]
        self.v0 = sum(sizes[:self.tp_rank])
        self.v1 = self.v0 + sizes[self.tp_rank]
        self.w_shard = None          # the head rows of the current update step (a leaf)
        self.lo = self.hi = None     # this rank's sequences of the current rollout
        self.n_local = self.n_global = None   # valid tokens of the current minibatch

    # ------------------------------------------------------------------ rollout
    def rows(self, n):
        self.lo, self.hi = n * self.dp_rank // self.dp, n * (self.dp_rank + 1) // self.dp
        return slice(self.lo, self.hi)

    def lm_head(self, policy, train):
        w = policy.lm_head_weight
        if self.tp == 1:
            return w, {}
        if train:
            # a leaf of its own: its gradient is this shard's dW, kept apart from the
            # embedding's (which is the same on every TP rank) until sync_grads
            self.w_shard = w.detach()[self.v0:self.v1].requires_grad_()
            w = self.w_shard
        else:
            w = w[self.v0:self.v1]
        return w, dict(tp_group=self.tp_group, vocab_start=self.v0)

    def whiten(self, pk, adv, mask):
        # pk.whiten over the whole rollout: the statistics all-reduced over the DP group
        return pk.whiten(adv, mask, group=self.dp_group if self.dp > 1 else None)

    def seq_mean(self, x):
        if self.dp == 1:
            return x.mean().item()
        t = torch.stack([x.sum().double(), torch.tensor(x.numel(), dtype=torch.float64)])
        dist.all_reduce(t, group=self.dp_group)
        return (t[0] / t[1]).item()

    # ------------------------------------------------------------------ update
    def minibatch(self, batch, idx):
        if self.dp == 1:
            return super().minibatch(batch, idx)
        # the single-process minibatch idx (indices into the whole rollout): the sequences
        # of it that this rank holds
        mine = idx[(idx >= self.lo) & (idx < self.hi)] - self.lo
        if mine.numel() == 0:
            raise RuntimeError(f"dp rank {self.dp_rank} holds no sequence of a minibatch: "
                               f"use fewer data-parallel ranks")
        return super().minibatch(batch, mine)

    def loss_counts(self, mb):
        if self.dp == 1:
            return {}
        self.n_local = mb["response_mask"].sum()
        self.n_global = self.n_local.clone()
        dist.all_reduce(self.n_global, group=self.dp_group)
        return dict(global_num_tokens=self.n_global)

    def value_loss(self, pk, values, mb, s):
        if self.dp == 1:
            return super().value_loss(pk, values, mb, s)
        # token-mean over the whole minibatch: this rank's share, with the global count
        return pk.value_loss(values, mb["old_values"], mb["returns"], mb["response_mask"],
                             clip_range=s.vf_clip, global_num_tokens=self.n_global)

    def sync_grads(self, policy):
        params = list(policy.parameters())
        if self.tp > 1:
            # the head shards' dW summed into the full [V, H] (zeros elsewhere: exact),
            # added to the tied parameter's gradient (the embedding's, the same on every
            # TP rank)
            w = policy.lm_head_weight
            dw = torch.zeros_like(w)
            dw[self.v0:self.v1] = self.w_shard.grad
            dist.all_reduce(dw, group=self.tp_group)
            w.grad = dw if w.grad is None else w.grad.add_(dw)
            self.w_shard = None
        if self.dp > 1:
            # each rank's loss is its share of the minibatch's: the gradients add up
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.dp_group)
            for p, g in zip(params, flat.split([g.numel() for g in grads]), strict=True):
                p.grad = g.view_as(p).clone()

    def step_metrics(self, pg_loss, v_loss, m, vm):
        if self.dp == 1:
            return super().step_metrics(pg_loss, v_loss, m, vm)
        import ppo_kernels as pk

        mm = pk.distributed.reduce_metrics(m, self.dp_group)
        t = torch.stack([pg_loss.detach().float(), v_loss.detach().float(),
                         vm["vf_clip_frac"] * self.n_local.float()])
        dist.all_reduce(t, group=self.dp_group)     # the shares add up to the losses
        pg, vl, clipped = t.tolist()
        return dict(pg_loss=pg, v_loss=vl, clip_frac=mm["clip_frac"].item(),
                    entropy=mm["entropy"].item(), approx_kl=mm["approx_kl"].item(),
                    vf_clip_frac=clipped / self.n_global.item())


def broadcast_model(*modules) -> None:
    """Rank 0's weights to every rank (they are equal already: same seed, same steps)."""
    for mod in modules:
        for t in list(mod.parameters()) + list(mod.buffers()):
            dist.broadcast(t.data, src=0)


def replicas_equal(policy) -> bool:
    """Whether every rank holds bit-identical weights (an elementwise max == min)."""
    flat = torch.cat([p.detach().reshape(-1) for p in policy.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def curve_difference(history: list[dict], reference: list[dict]) -> dict:
    """max |this - reference| per column over the common iterations."""
    n = min(len(history), len(reference))
    return {k: max(abs(a[k] - b[k]) for a, b in zip(history[:n], reference[:n]))
            for k in CURVE_KEYS if all(k in h for h in history[:n] + reference[:n])}


def parse_args(argv=None):
    p = demo.make_parser(__doc__.split("\n\n")[0])
    p.set_defaults(out="out/ppo_torchrun.png")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (vocabulary)")
    p.add_argument("--compare", default=None,
                   help="a single-process run's --json: print the largest difference")
    p.add_argument("--no-plot", action="store_true", help="no PNG")
    return p.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.device != "cpu":
        raise SystemExit("--device: this example runs on the CPU (gloo)")
    if args.dp < 1 or args.tp < 1:
        raise SystemExit("--dp and --tp must be at least 1")
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --nproc-per-node 2 "
                         "examples/ppo_torchrun.py --dp 1 --tp 2")
    t_start = time.perf_counter()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lead = rank == 0

    def log(msg):
        if lead:
            print(msg, flush=True)

    if not lead:
        args.no_progress = True
    run = demo.setup(args, log=log, banner=f"ppo_torchrun dp={args.dp} tp={args.tp}")
    par = Parallel(args.dp, args.tp, len(run.vocab))
    broadcast_model(run.policy, run.ref_lm)

    replicas = []

    def check(h):
        replicas.append(replicas_equal(run.policy))
        if not replicas[-1]:
            raise RuntimeError(f"iteration {h['iter']}: the ranks' weights differ")

    history, ppo_time, t_rollout, t_update = demo.train(
        run, par, log=log if args.no_progress else demo.tqdm.write,
        progress=not args.no_progress, on_iteration=check)
    log(f"PPO: {run.s.iterations} iterations on {args.dp * args.tp} ranks (dp={args.dp}, "
        f"tp={args.tp}) in {ppo_time:.1f}s (rollouts {t_rollout:.1f}s, updates "
        f"{t_update:.1f}s); replicas bit-identical after every iteration: {all(replicas)}")
    summary = None
    if lead:
        summary = dict(dp=args.dp, tp=args.tp, world=args.dp * args.tp, seed=args.seed,
                       quick=args.quick, backend=run.backend,
                       settings=demo.asdict(run.s), replicas_identical=all(replicas),
                       ppo_seconds=ppo_time, history=history)
        if args.compare:
            with open(args.compare) as f:
                ref = json.load(f)["history"]
            diff = curve_difference(history, ref)
            summary["max_difference"] = diff
            summary["compared_with"] = args.compare
            print(f"max |difference| to {args.compare} over {min(len(ref), len(history))} "
                  f"iterations: " + ", ".join(f"{k} {v:.2g}" for k, v in diff.items()))
        if not args.no_plot:
            demo.plot(history, args.out, f"PPO on {args.dp * args.tp} ranks (dp={args.dp}, "
                                         f"tp={args.tp}), seed={args.seed}")
            print(f"plot: {args.out}")
        summary["total_seconds"] = time.perf_counter() - t_start
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
        ok = all(math.isfinite(h["kl_ref"]) for h in history)
        if not ok:
            print("[non-finite KL!]")
    dist.barrier()
    dist.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
