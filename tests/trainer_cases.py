"""The two-process cases of tests/test_lm_head.py: the from-hidden ops inside the trainers
people run (DDP, FSDP2, DeepSpeed ZeRO-3), on 2 gloo processes (CPU):

    python tests/trainer_cases.py RANK PORT OUT_DIR [all | torch]   (helpers/ranks.py)

Every rank builds the same tiny model (embedding -> linear + tanh backbone -> LM head) and
the same batch of 2 * B sequences; rank r trains on rows [r B, (r + 1) B). Each case runs
one forward and backward under the framework and compares, against the single-process run
on the whole batch (the same op, no wrapper): the loss (the ranks' shares summed) and every
parameter's gradient (all-gathered from the shards where the framework shards them).
Each rank writes OUT_DIR/rank<r>.json: {case: {"loss": rel err, "grad": max rel err}} or
{case: "error: ..."}; {"deepspeed": "absent: ..."} where deepspeed does not import
("torch": the DDP / FSDP2 cases only).
"""

import contextlib
import copy
import functools
import os
import sys

import torch
import torch.distributed as dist

import ppo_kernels as pk

from helpers.asserts import max_rel_err
from helpers.ranks import case, rank_main

B, T, V, H, VOCAB_IN = 3, 5, 13, 6, 17
WORLD = 2


class Backbone(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB_IN, H)
        self.proj = torch.nn.Linear(H, H)

    def forward(self, ids):
        return torch.tanh(self.proj(self.embed(ids)))


class Policy(torch.nn.Module):
    """forward(ids) -> the last hidden states [B, T, H]: the head is the caller's."""

    def __init__(self, bias):
        super().__init__()
        self.backbone = Backbone()
        self.lm_head = torch.nn.Linear(H, V, bias=bias)

    def forward(self, ids):
        return self.backbone(ids)


def data():
    g = torch.Generator().manual_seed(1)
    n = WORLD * B
    ids = torch.randint(0, VOCAB_IN, (n, T), generator=g)
    tok = torch.randint(0, V, (n, T), generator=g)
    old = torch.randn(n, T, generator=g) * 0.3 - 2.0
    adv = torch.randn(n, T, generator=g)
    mask = torch.rand(n, T, generator=g) > 0.25
    mask[1] = False  # an empty response
    ref = torch.randn(n, T, generator=g) * 0.3 - 2.0
    return ids, tok, old, adv, mask, ref


def op_loss(kind, hidden, head, tok, old, adv, mask, ref, n_tok, n_seq):
    """The loss of one op; head: the module or its weight tensor (bias then separate)."""
    if isinstance(head, torch.nn.Module):
        w, b = head, None
    else:
        w, b = head
    if kind == "logprobs":  # token_logprobs_from_hidden: the backward recomputes the logits
        lp, ent = pk.token_logprobs_from_hidden(hidden, w, tok, mask, lm_head_bias=b,
                                                return_entropy=True, chunk_size=4)
        m = mask.float()
        return ((lp * adv + 0.1 * ent) * m).sum() / n_tok
    opts = dict(policy_loss="vanilla", loss_agg_mode="token-mean", global_num_tokens=n_tok)
    if kind == "gspo":  # the two-phase path
        opts = dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean",
                    global_num_seqs=n_seq)
    loss, _ = pk.ppo_loss_from_hidden(hidden, w, tok, old, adv, mask, ref, lm_head_bias=b,
                                      chunk_size=4, kl_coef=0.05, entropy_coef=0.01, **opts)
    return loss


def reference(model, kind, batch):
    """Single process, whole batch: (loss, {name: grad})."""
    m = copy.deepcopy(model)
    ids, tok, old, adv, mask, ref = batch
    n_tok = mask.sum().float()
    n_seq = mask.any(1).sum().float()
    loss = op_loss(kind, m(ids), (m.lm_head.weight, m.lm_head.bias), tok, old, adv, mask,
                   ref, n_tok, n_seq)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}


def full_grad(p):
    g = p.grad
    if g is None:
        return None
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def compare(loss_share, grads, want):
    """loss_share: this rank's share (times WORLD: the frameworks average the gradients);
    grads: {name: this rank's view of the whole gradient}."""
    tot = loss_share.detach().clone() / WORLD
    dist.all_reduce(tot)
    loss_ref, grads_ref = want
    err = {"loss": max_rel_err(tot, loss_ref)}
    missing = [k for k in grads_ref if grads.get(k) is None]
    if missing:
        raise AssertionError(f"no gradient for {missing}")
    err["grad"] = max(max_rel_err(grads[k], grads_ref[k]) for k in grads_ref)
    return err


def local(batch, rank):
    ids, tok, old, adv, mask, ref = batch
    rows = slice(rank * B, (rank + 1) * B)
    n_tok = mask.sum().float() / WORLD  # the whole batch's counts, divided by the world
    n_seq = mask.any(1).sum().float() / WORLD  # size: DDP / FSDP average the gradients
    return ids[rows], tok[rows], old[rows], adv[rows], mask[rows], ref[rows], n_tok, n_seq


def ddp_case(model, kind, batch, rank, find_unused, head_as):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=find_unused)
    ids, tok, old, adv, mask, ref, n_tok, n_seq = local(batch, rank)

    def step(ids):  # the whole step as DDP's forward: every parameter it uses is seen
        inner = ddp.module
        head = inner.lm_head if head_as == "module" else (inner.lm_head.weight,
                                                          inner.lm_head.bias)
        return op_loss(kind, inner(ids), head, tok, old, adv, mask, ref, n_tok, n_seq)

    loss = pk.forward_redirect(ddp, step, ids)
    loss.backward()
    return loss, {k: p.grad for k, p in ddp.module.named_parameters()}


def fsdp_case(model, kind, batch, rank, layout, reshard):
    from torch.distributed.fsdp import fully_shard
    m = copy.deepcopy(model)
    if layout == "own_unit":
        fully_shard(m.lm_head, reshard_after_forward=reshard)
    fully_shard(m.backbone, reshard_after_forward=reshard)
    fully_shard(m, reshard_after_forward=reshard)
    ids, tok, old, adv, mask, ref, n_tok, n_seq = local(batch, rank)
    if layout == "own_unit":  # the root's forward, then the head's module form
        hidden = m(ids)
        if reshard:
            m.reshard()  # every unit sharded again: the head's forward gathers its own
        loss = op_loss(kind, hidden, m.lm_head, tok, old, adv, mask, ref, n_tok, n_seq)
    else:  # the head in the root unit: the whole step as the root's forward
        def step(ids):
            if reshard:
                m.backbone.reshard()
            return op_loss(kind, m.backbone(ids), m.lm_head, tok, old, adv, mask, ref,
                           n_tok, n_seq)
        loss = pk.forward_redirect(m, step, ids)
    loss.backward()
    return loss, {k: full_grad(p) for k, p in m.named_parameters()}


def fsdp_root_after_forward(model, batch, rank):
    """The head in the root unit, read right after the root's forward (the root keeps its
    parameters whole until the backward): the module form alone."""
    from torch.distributed.fsdp import fully_shard
    m = copy.deepcopy(model)
    fully_shard(m.backbone)
    fully_shard(m)
    ids, tok, old, adv, mask, ref, n_tok, n_seq = local(batch, rank)
    hidden = m(ids)
    loss = op_loss("vanilla", hidden, m.lm_head, tok, old, adv, mask, ref, n_tok, n_seq)
    loss.backward()
    return loss, {k: full_grad(p) for k, p in m.named_parameters()}


def fsdp_resharded_root(model, batch, rank):
    """The head in the root unit after reshard(), the module form without the
    redirection through the root: its weight is a shard, a ValueError naming it."""
    from torch.distributed.fsdp import fully_shard
    m = copy.deepcopy(model)
    fully_shard(m)
    ids, tok, old, adv, mask, ref, n_tok, n_seq = local(batch, rank)
    hidden = m(ids)
    m.reshard()
    try:
        op_loss("vanilla", hidden, m.lm_head, tok, old, adv, mask, ref, n_tok, n_seq)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def zero3_case(model, kind, batch, rank):
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    from deepspeed.utils import safe_get_full_grad
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (a speed-up only) on
    # its first init: minutes of C++ on a CI machine. gloo's collectives do the same work.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    m = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
           "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
           "wall_clock_breakdown": False}
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                          config=cfg)
    ids, tok, old, adv, mask, ref, n_tok, n_seq = local(batch, rank)
    hidden = engine(ids)
    loss = op_loss(kind, hidden, engine.module.lm_head, tok, old, adv, mask, ref, n_tok,
                   n_seq)
    engine.backward(loss)
    grads = {k: safe_get_full_grad(p) for k, p in engine.module.named_parameters()}
    # ZeRO reduces the gradients as a mean over ranks (like DDP), unless told otherwise
    return loss, grads


def against_reference(fn, model, kind, batch):
    """The framework's run (fn) against the single-process run on the whole batch."""
    loss, grads = fn()
    return compare(loss, grads, reference(model, kind, batch))


def setup(r):
    """The two models (without and with a bias), built alike on every rank after the seed,
    and the batch."""
    return {b: Policy(bias=b) for b in (False, True)}, data()


def cases(r):
    """Every framework x op x layout (r.args[0] "torch": without DeepSpeed ZeRO-3)."""
    (models, batch), rank = r.state, r.rank
    out = []
    for kind in ("vanilla", "gspo", "logprobs"):
        for bias in (False, True):
            mdl = models[bias]
            tag = f"{kind}/bias={bias}"
            for fu in (False, True):
                for head_as in ("module", "tensors"):
                    out.append(case(f"ddp/find_unused={fu}/{head_as}/{tag}", against_reference,
                                    functools.partial(ddp_case, mdl, kind, batch, rank, fu,
                                                      head_as), mdl, kind, batch))
            for layout in ("own_unit", "root_unit"):
                for reshard in (True, False):
                    out.append(case(f"fsdp2/{layout}/reshard={reshard}/{tag}",
                                    against_reference,
                                    functools.partial(fsdp_case, mdl, kind, batch, rank,
                                                      layout, reshard), mdl, kind, batch))
    out.append(case("fsdp2/root_unit/after_forward", against_reference,
                    functools.partial(fsdp_root_after_forward, models[True], batch, rank),
                    models[True], "vanilla", batch))
    out.append(case("fsdp2/root_unit/resharded_module_form", fsdp_resharded_root,
                    models[False], batch, rank))
    if (r.args or ["all"])[0] == "all":
        out += zero3_cases(rank, models, batch)
    return out


def zero3_cases(rank, models, batch):
    try:
        import deepspeed  # noqa: F401
    except Exception as e:
        msg = f"absent: {type(e).__name__}: {e}"
        return [case("deepspeed", lambda: msg)]
    return [case(f"zero3/{kind}", against_reference,
                 functools.partial(zero3_case, models[True], kind, batch, rank), models[True],
                 kind, batch) for kind in ("vanilla", "gspo", "logprobs")]


if __name__ == "__main__":
    rank_main(cases, seed=0, setup=setup, barrier_each=True, env=dict(DS_ACCELERATOR="cpu"))
