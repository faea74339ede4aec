"""The two-process cases of tests/test_lm_head.py for the LM head used after the forward of
DistributedDataParallel(find_unused_parameters=True), on 2 gloo processes (CPU):

    python tests/ddp_after_forward_cases.py RANK PORT OUT_DIR   (helpers/ranks.py)

The loop people write: ``hidden = ddp(ids)`` (the wrapped model returns the last hidden
states), then the from-hidden op with ``ddp.module.lm_head`` (or its weight and bias),
then ``loss.backward()``; two iterations (the second finds DDP's state of the first
finalised). Every rank trains on its rows of the batch of tests/trainer_cases.py; the loss
(the ranks' shares summed) and every parameter's gradient are compared with the
single-process run on the whole batch. Each rank writes OUT_DIR/rank<r>.json:
{case: {"loss": rel err, "grad": max rel err}} or {case: "error: ..."}.
"""

import copy

import torch

import ppo_kernels as pk

from helpers.ranks import case, rank_main
from trainer_cases import B, H, T, V, WORLD, Policy, compare, data, local, op_loss


class ValuePolicy(Policy):
    """forward(ids) -> (hidden [B, T, H], values [B, T]): a value head used inside the
    forward, the LM head after it."""

    def __init__(self, bias):
        super().__init__(bias)
        self.value = torch.nn.Linear(H, 1)

    def forward(self, ids):
        h = self.backbone(ids)
        return h, self.value(h).squeeze(-1)


def teacher():
    """A top-3 teacher over the whole batch's positions (CSR, row-major)."""
    g = torch.Generator().manual_seed(2)
    n = WORLD * B * T
    ids = torch.stack([torch.randperm(V, generator=g)[:3] for _ in range(n)]).reshape(-1)
    lp = torch.log_softmax(torch.randn(n, 4, generator=g), -1)[:, :3].reshape(-1)
    return pk.SparseLogprobs(ids, torch.arange(0, 3 * n + 1, 3), lp)


def teacher_rows(te, rank):
    n = B * T
    o0 = int(te.offsets[rank * n])
    o1 = int(te.offsets[(rank + 1) * n])
    return pk.SparseLogprobs(te.token_ids[o0:o1], te.offsets[rank * n:(rank + 1) * n + 1] - o0,
                             te.logprobs[o0:o1])


def loss_of(kind, hidden, head, args, te):
    tok, old, adv, mask, ref, n_tok, n_seq = args
    if kind != "distill":
        return op_loss(kind, hidden, head, tok, old, adv, mask, ref, n_tok, n_seq)
    w, b = (head, None) if isinstance(head, torch.nn.Module) else head
    loss, _ = pk.distill_loss_from_hidden(hidden, w, te, mask, lm_head_bias=b, chunk_size=4,
                                          global_num_tokens=n_tok)
    return loss


def step_loss(kind, out, head, args, te, variant):
    hidden, values = out if isinstance(out, tuple) else (out, None)
    if variant == "derived":  # the sink a few autograd nodes back
        hidden = hidden[:, :T] * 1.0
    loss = loss_of(kind, hidden, head, args, te)
    if values is not None:  # the value head: used inside the forward
        loss = loss + 0.1 * (values * args[3]).pow(2).sum() / args[5]
    return loss


def reference(model, kind, batch, te, variant):
    m = copy.deepcopy(model)
    ids, tok, old, adv, mask, ref = batch
    args = (tok, old, adv, mask, ref, mask.sum().float(), mask.any(1).sum().float())
    loss = step_loss(kind, m(ids), (m.lm_head.weight, m.lm_head.bias), args, te, variant)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}


def ddp_after_forward(model, kind, batch, te, rank, head_as, variant):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ids, tok, old, adv, mask, ref, n_tok, n_seq = local(batch, rank)
    args = (tok, old, adv, mask, ref, n_tok, n_seq)
    te_r = teacher_rows(te, rank)
    for it in range(2):
        ddp.zero_grad(set_to_none=True)
        if variant == "no_sync":  # gradient accumulation: one micro-batch without the sync
            with ddp.no_sync():
                head = _head(ddp, head_as)
                step_loss(kind, ddp(ids), head, args, te_r, variant).backward()
        head = _head(ddp, head_as)
        loss = step_loss(kind, ddp(ids), head, args, te_r, variant)
        loss.backward()
    grads = {k: p.grad for k, p in ddp.module.named_parameters()}
    if variant == "no_sync":  # the synced step averages the accumulated gradients of two
        grads = {k: None if g is None else g / 2 for k, g in grads.items()}  # equal micro-
        # batches: twice the single step's
    return loss, grads


def _head(ddp, head_as):
    inner = ddp.module
    return inner.lm_head if head_as == "module" else (inner.lm_head.weight,
                                                      inner.lm_head.bias)


def setup(r):
    """The models (without and with a bias, and with a value head), built alike on every
    rank after the seed, the batch and the teacher."""
    return ({b: Policy(bias=b) for b in (False, True)}, ValuePolicy(bias=True), data(),
            teacher())


def against_reference(model, kind, batch, te, rank, head_as, variant):
    loss, grads = ddp_after_forward(model, kind, batch, te, rank, head_as, variant)
    return compare(loss, grads, reference(model, kind, batch, te, variant))


def cases(r):
    models, valued, batch, te = r.state
    out = []

    def add(name, model, kind, head_as, variant="plain"):
        out.append(case(name, against_reference, model, kind, batch, te, r.rank, head_as,
                        variant))

    for kind in ("vanilla", "gspo", "logprobs", "distill"):
        for bias in (False, True):
            for head_as in ("module", "tensors"):
                add(f"{kind}/bias={bias}/{head_as}", models[bias], kind, head_as)
    add("vanilla/derived_hidden/module", models[True], "vanilla", "module", "derived")
    add("vanilla/value_head_in_forward/module", valued, "vanilla", "module")
    add("vanilla/no_sync_then_sync/module", models[True], "vanilla", "module", "no_sync")
    add("distill/value_head_in_forward/tensors", valued, "distill", "tensors")
    return out


if __name__ == "__main__":
    rank_main(cases, seed=0, setup=setup, barrier_each=True)
