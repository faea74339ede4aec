"""The report's ops (benchmarks/report.py documents them): the inputs of each and its
variants, {backend: step(inputs) -> what is compared with the eager composite's output}."""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_bench  # noqa: E402  (its inputs and eager composite)
import from_hidden_bench  # noqa: E402  (its inputs and composite)

import ppo_kernels as pk  # noqa: E402
from ppo_kernels import _torch_impl  # noqa: E402

OPS = ["token_logprobs", "ppo_loss", "ppo_loss_gspo", "score_rollout", "gae",
       "ppo_loss_from_hidden"]
GSPO = pk.LossSpec.build(policy_loss="gspo")
KL = 0.05


# ------------------------------------------------------------------ inputs

@functools.lru_cache(maxsize=1)  # (the same for the four logits ops and the floor of a point)
def logits_inputs(n, v, dtype, device):
    """cpu_bench.make_inputs' logits [8, N / 8, V], tokens, mask, old, adv, and ref, values
    [8, N / 8], scores [8] for score_rollout (no step writes into them)."""
    logits, tokens, mask, old, adv = cpu_bench.make_inputs(n, v, dtype)
    g = torch.Generator().manual_seed(1)
    x = dict(logits=logits, tokens=tokens, mask=mask, old=old, adv=adv,
             ref=old - 0.05 * torch.rand(old.shape, generator=g),
             values=torch.randn(old.shape, generator=g),
             scores=torch.randn(old.shape[0], generator=g))
    return {k: t.to(device) for k, t in x.items()}


def gae_inputs(n, device):
    """float32 rewards, values, mask [8, N / 8], and both [2, 8, N / 8] (the gae floor's)."""
    g = torch.Generator().manual_seed(2)
    b = 8 if n % 8 == 0 else 1
    t = n // b
    x = dict(rewards=torch.randn(b, t, generator=g), values=torch.randn(b, t, generator=g),
             mask=torch.rand(b, t, generator=g) > 0.1)
    x["both"] = torch.stack([x["rewards"], x["values"]])  # what the gae floor copies
    return {k: t.to(device) for k, t in x.items()}


def hidden_inputs(n, h, v, dtype, device):
    names = ("hidden", "w", "tokens", "mask", "old", "adv")
    return {k: t.to(device) for k, t in zip(names, from_hidden_bench.make_inputs(n, h, v, dtype))}


# ------------------------------------------------------------------ the variants
# each op: backend -> step(x) -> the tensor(s) compared with the eager composite's

def train_step(loss_fn, x, *leaves):
    """loss_fn(leaf tensors...).backward(); returns their gradients."""
    xs = [x[k].detach().requires_grad_(True) for k in leaves]
    loss_fn(*xs).backward()
    return tuple(t.grad for t in xs)


def variants(op, fused, device, gae_compile_max_t):
    """{backend: step(x)} for op; fused: the fused backends ("cpu" or "cuda", "triton")."""
    out = {}
    if op == "token_logprobs":
        def tl(be):
            return lambda x: pk.token_logprobs(x["logits"], x["tokens"], x["mask"], backend=be)
        comp = torch.compile(lambda lg, tk, m: _torch_impl.token_logprobs(lg, tk, m, 1.0, False)[0],
                             dynamic=False)
        out = {be: tl(be) for be in fused + ["torch"]}
        out["torch.compile"] = lambda x: comp(x["logits"], x["tokens"], x["mask"])
        out = {k: _no_grad(f) for k, f in out.items()}
    elif op in ("ppo_loss", "ppo_loss_gspo"):
        pl = "gspo" if op == "ppo_loss_gspo" else "vanilla"

        def ppo(be):
            return lambda x: train_step(lambda lg: pk.ppo_loss(
                lg, x["tokens"], x["old"], x["adv"], x["mask"], policy_loss=pl,
                backend=be)[0], x, "logits")
        comp = torch.compile(cpu_bench.composite, dynamic=False)
        p = GSPO if pl == "gspo" else cpu_bench.P
        out = {be: ppo(be) for be in fused + ["torch"]}
        out["torch.compile"] = lambda x: train_step(lambda lg: comp(
            lg, x["tokens"], x["mask"], x["old"], x["adv"], p), x, "logits")
    elif op == "score_rollout":
        def sr(be):
            return lambda x: pk.score_rollout(x["logits"], x["tokens"], x["ref"], x["values"],
                                              x["scores"], x["mask"], kl_coef=KL, whiten=False,
                                              backend=be)[:4]
        comp = torch.compile(_rollout_head, dynamic=False)

        def sr_compiled(x):
            logp, kl, rewards = comp(x["logits"], x["tokens"], x["mask"], x["ref"], x["scores"])
            adv, _ = _torch_impl.gae(rewards, x["values"], x["mask"], None, 1.0, 0.95)
            return logp, kl, rewards, adv
        out = {be: sr(be) for be in fused + ["torch"]}
        out["torch.compile"] = sr_compiled
        out = {k: _no_grad(f) for k, f in out.items()}
    elif op == "gae":
        def ga(be):
            return lambda x: pk.gae(x["rewards"], x["values"], x["mask"], backend=be)
        out = {be: ga(be) for be in fused + ["torch"]}
        comp = torch.compile(_torch_impl.gae, dynamic=False)
        out["torch.compile"] = lambda x: (
            comp(x["rewards"], x["values"], x["mask"], None, 1.0, 0.95)
            if x["rewards"].shape[1] <= gae_compile_max_t else _skip("T > --gae-compile-max-t"))
    elif op == "ppo_loss_from_hidden":
        def fh(be):
            return lambda x: train_step(lambda h, w: pk.ppo_loss_from_hidden(
                h, w, x["tokens"], x["old"], x["adv"], x["mask"], backend=be)[0], x,
                "hidden", "w")

        def mat(be):
            return lambda x: train_step(lambda h, w: pk.ppo_loss(
                F.linear(h, w), x["tokens"], x["old"], x["adv"], x["mask"], backend=be)[0], x,
                "hidden", "w")
        comp = torch.compile(from_hidden_bench.composite, dynamic=False)
        out = {be: fh(be) for be in fused}
        out[f"{fused[0]}, materialised"] = mat(fused[0])
        out["torch"] = fh("torch")
        out["torch.compile"] = lambda x: train_step(lambda h, w: comp(
            h, w, x["tokens"], x["mask"], x["old"], x["adv"]), x, "hidden", "w")
    return out


def _rollout_head(logits, tokens, mask, ref, scores):
    """score_rollout's composite up to the GAE scan (what torch.compile gets)."""
    logp, _ = _torch_impl.token_logprobs(logits, tokens, mask, 1.0, False)
    rewards, kl = _torch_impl.kl_penalized_rewards(scores, logp, ref, mask, KL, "k1")
    return logp, kl, rewards


def _no_grad(f):
    def run(x):
        with torch.no_grad():
            return f(x)
    return run


class Skipped(Exception):
    """A variant that does not run here (its reason is printed, no row is written)."""


def _skip(why):
    raise Skipped(why)


def inputs_for(op, n, v, h, dtype, device):
    """The inputs dict of op at N tokens, vocabulary V, hidden size H (the floor's: the
    logits ops')."""
    if op == "gae":
        return gae_inputs(n, device)
    if op == "ppo_loss_from_hidden":
        return hidden_inputs(n, h, v, dtype, device)
    return logits_inputs(n, v, dtype, device)
