"""Tests of ppo_kernels/context_parallel.py, the context-parallel path (cp_group: each rank
holds a piece of every sequence): cp_group that is not a process group, and on 2 gloo
processes (tests/two_rank_cases.py) packed sequences of unequal pieces on the ranks.
(Every op with cp_group over 2, 3 and 4 processes: test_distributed.py.)
"""

import pytest

import ppo_kernels as pk

from helpers.asserts import raises_naming
from helpers.inputs import packed_batch


@pytest.mark.parametrize("bad", ["x", 5])
def test_cp_group_not_a_process_group(group1, bad):
    """cp_group that is not a process group: an error naming cp_group."""
    d = packed_batch()
    raises_naming(lambda: pk.ppo_loss(d["logits"][None], d["tokens"][None], d["old"][None],
                                      d["adv"][None], policy_loss="gspo", cp_group=bad), "cp_group")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_cp_over_packed_sequences(two_ranks, mode):
    """cp_group with cu_seqlens, the pieces of unequal lengths on the ranks: the sum of the
    ranks' losses is the whole batch's, each rank's gradient that loss's. (The
    seq-mean-token-sum-norm length must be the whole sequences' longest, not the sum of
    each rank's padded width.)"""
    for rank, res in enumerate(two_ranks):
        for pl in ("vanilla", "gspo"):
            e = res[f"cp_packed/{pl}/{mode}"]
            assert max(e) <= 1e-5, f"rank {rank} {pl}: relative errors (loss, grad) {e}"
