"""Tests of ppo_kernels/vocab_parallel.py, the tensor-parallel (split vocabulary) path:
tp_group / vocab_start and DTensor logits. Bad arguments are a ValueError or TypeError
naming the argument (never a crash, an AttributeError / IndexError or a silent result),
on a 1-process gloo group where a group is needed; 2 gloo processes (tests/two_rank_cases.py)
for what needs a vocabulary really split: a whole shard of -inf logits, shards that overlap
or leave a gap. (Every op split over 2, 3 and 4 processes: test_distributed.py.)
"""

import pytest
import torch

import ppo_kernels as pk

from helpers.asserts import raises_naming
from helpers.inputs import PK_TOTAL, PK_V, packed_batch


def test_vocab_start_without_tp_group():
    """vocab_start without tp_group is an error naming vocab_start (ppo_loss,
    token_logprobs, ppo_loss_from_hidden)."""
    d = packed_batch()
    raises_naming(lambda: pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"], vocab_start=0),
                  "vocab_start")
    raises_naming(lambda: pk.token_logprobs(d["logits"], d["tokens"], vocab_start=3), "vocab_start")
    raises_naming(lambda: pk.ppo_loss_from_hidden(d["hidden"], d["weight"], d["tokens"], d["old"],
                                                  d["adv"], vocab_start=0), "vocab_start")


def test_tp_group_with_the_torch_backend(group1):
    """tp_group with backend="torch" (the eager composite has no split-vocabulary
    path): an error naming backend."""
    d = packed_batch()
    lg, tok = d["logits"][None], d["tokens"][None]
    old, adv, m = d["old"][None], d["adv"][None], d["mask"][None]
    for pl in ("vanilla", "gspo"):
        raises_naming(lambda: pk.ppo_loss(lg, tok, old, adv, m, tp_group=group1, policy_loss=pl,
                                          backend="torch"), "backend")
    raises_naming(lambda: pk.token_logprobs(lg, tok, tp_group=group1, backend="torch"), "backend")
    raises_naming(lambda: pk.score_rollout(lg, tok, old, old, torch.randn(1), m, kl_coef=0.1,
                                           tp_group=group1, backend="torch"), "backend")
    raises_naming(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], d["weight"], tok, old, adv, m,
                                                  tp_group=group1, backend="torch"), "backend")


@pytest.mark.parametrize("value", [-1, 1.5, 0.0, "0", True, None])
def test_bad_vocab_start(group1, value):
    """vocab_start negative or not a Python int (a float, a string, a bool, a 0-d
    tensor): an error naming vocab_start."""
    d = packed_batch()
    lg, tok = d["logits"][None], d["tokens"][None]
    old, adv = d["old"][None], d["adv"][None]
    if value is None:  # numpy / tensor ints are not python ints either
        value = torch.tensor(0)
    raises_naming(lambda: pk.ppo_loss(lg, tok, old, adv, tp_group=group1, vocab_start=value),
                  "vocab_start")
    raises_naming(lambda: pk.token_logprobs(lg, tok, tp_group=group1, vocab_start=value),
                  "vocab_start")
    raises_naming(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], d["weight"], tok, old, adv,
                                                  tp_group=group1, vocab_start=value),
                  "vocab_start")


def test_vocab_start_leaving_tokens_out(group1):
    """One rank whose shard starts at 3: the shards do not tile the vocabulary (ids below 3
    belong to no shard), named as vocab_start on every op."""
    d = packed_batch()
    tok = d["tokens"].clone()
    tok[0] = 1
    m = torch.ones(PK_TOTAL, dtype=torch.bool)
    raises_naming(lambda: pk.ppo_loss(d["logits"], tok, d["old"], d["adv"], m, tp_group=group1,
                                      vocab_start=3), "vocab_start")
    raises_naming(lambda: pk.token_logprobs(d["logits"], tok, m, tp_group=group1, vocab_start=3),
                  "vocab_start")
    # a valid id outside the whole vocabulary names the tokens ...
    v = d["logits"].shape[-1]
    bad = tok.clone()
    bad[0] = v
    raises_naming(lambda: pk.token_logprobs(d["logits"], bad, m, tp_group=group1), "tokens")
    # ... but a masked position may hold any id
    m[0] = False
    pk.token_logprobs(d["logits"], bad, m, tp_group=group1)


@pytest.mark.parametrize("bad", ["x", 5])
def test_tp_group_not_a_process_group(group1, bad):
    """tp_group that is not a process group: an error naming tp_group (not torch's
    "Group x is not registered")."""
    d = packed_batch()
    raises_naming(lambda: pk.ppo_loss(d["logits"][None], d["tokens"][None], d["old"][None],
                                      d["adv"][None], tp_group=bad), "tp_group")


def test_dtensor_wrong_placement(group1):
    """DTensor logits not sharded on the vocabulary (replicated, or sharded on batch or
    time) or given with tp_group / vocab_start, and a DTensor lm_head weight not sharded on
    its rows: errors naming logits / lm_head_weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    d = packed_batch()
    lg = d["logits"].reshape(1, PK_TOTAL, PK_V)
    tok, old, adv = d["tokens"][None], d["old"][None], d["adv"][None]
    for pl in ([Replicate()], [Shard(0)], [Shard(1)]):
        dt = distribute_tensor(lg.clone(), mesh, pl)
        raises_naming(lambda: pk.ppo_loss(dt, tok, old, adv), "logits")
        raises_naming(lambda: pk.token_logprobs(dt, tok), "logits")
        raises_naming(lambda: pk.score_rollout(dt, tok, old, old, torch.randn(1), None,
                                               kl_coef=0.1), "logits")
    good = distribute_tensor(lg.clone(), mesh, [Shard(-1)])
    raises_naming(lambda: pk.ppo_loss(good, tok, old, adv, tp_group=group1), "logits")
    raises_naming(lambda: pk.ppo_loss(good, tok, old, adv, vocab_start=0), "logits")
    for pl in ([Replicate()], [Shard(1)]):
        w = distribute_tensor(d["weight"].clone(), mesh, pl)
        raises_naming(lambda: pk.ppo_loss_from_hidden(d["hidden"][None], w, tok, old, adv),
                      "lm_head_weight")


@pytest.mark.parametrize("what", ["token_logprobs", "ppo_loss"])
def test_tp_whole_shard_of_neg_inf(two_ranks, what):
    """A row whose logits are -inf on one rank's whole shard (the token in the other):
    finite results, equal to the unsharded op's (logp, entropy / loss, gradient)."""
    for rank, res in enumerate(two_ranks):
        v = res["neginf_shard/" + what]
        assert not isinstance(v, str), f"rank {rank}: {v}"
        assert max(v) <= 1e-5, f"rank {rank}: relative errors {v} (1e30: NaN)"


@pytest.mark.parametrize("case", ["overlap", "gap"])
def test_tp_shards_that_overlap_or_leave_a_gap(two_ranks, case):
    """vocab_start values whose shards overlap or leave a gap make every row's softmax
    wrong (an entry counted twice, or missing) even when no sampled token lies there: a
    ValueError naming vocab_start on every rank, not a silent result."""
    for rank, res in enumerate(two_ranks):
        v = res[case]
        assert v.startswith("raised"), f"rank {rank}: {v}"
        assert "vocab_start" in v, f"rank {rank}: {v}"
