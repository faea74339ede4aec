"""ppo_kernels/rank_agreement.py: a bad input on one rank of tp_group or cp_group makes
every rank raise a ValueError naming the argument (and the rank), within seconds: no rank
waits in a collective until the process group's timeout, none aborts, none returns a
silent result. Two gloo processes (tests/rank_agreement_cases.py) whose process
group times out after 30 s, so a hang fails the test instead of stalling it; the healthy
control is the same calls without the fault, equal to the unsharded op."""

import os

import pytest

from helpers.ranks import run_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_agreement_cases.py")
    return run_ranks(script, tmp_path_factory.mktemp("agree"), timeout=240)


FAULTS = {  # case -> the argument the message names
    "tp/advantages_shape": "advantages",
    "tp/batch_sizes": "tokens",
    "tp/token_differs": "tokens",
    "tp/empty_shard": "logits",
    "tp/token_logprobs_mask": "response_mask",
    "tp/from_hidden_shape": "lm_head_weight",
    "tp/token_logprobs_from_hidden_shape": "lm_head_weight",
    "tp/score_rollout_scores": "scores",
    "tp/score_rollout_packed_cu_seqlens": "cu_seqlens",
    "tp/score_rollout_packed_scores": "scores",
    "tp/score_rollout_packed_num_seqs": "tokens",
    "tp/score_rollout_from_hidden_packed_cu_seqlens": "cu_seqlens",
    "tp/score_rollout_from_hidden_scores": "scores",
    "cp/token_range": "tokens",
    "cp/batch_sizes": "tokens",
    "cp/cu_seqlens": "cu_seqlens",
    "dtensor/head_without_tp_group": "tp_group",
}


@pytest.mark.parametrize("case", ["tp/healthy", "cp/healthy", "dtensor/head_with_tp_group",
                                  "tp/packed_healthy"])
def test_healthy_calls_run(ranks, case):
    for rank in range(2):
        assert ranks[rank][case][0] == "ok", f"rank {rank}: {ranks[rank][case][0]}"


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_a_fault_on_one_rank_is_an_error_on_every_rank(ranks, case):
    for rank in range(2):
        msg, seconds = ranks[rank][case]
        assert msg.startswith("ValueError:"), f"rank {rank}: {msg}"
        assert FAULTS[case] in msg, f"rank {rank}: the message does not name " \
                                    f"{FAULTS[case]!r}: {msg}"
        assert seconds < 10, f"rank {rank} took {seconds:.1f} s: it waited for a timeout"
    # the healthy rank says which rank's inputs were bad (a fault of both, such as a size
    # the ranks disagree on or the DTensor head, is each rank's own)
    if case not in ("tp/batch_sizes", "cp/batch_sizes", "tp/token_differs",
                    "tp/score_rollout_packed_num_seqs",
                    "dtensor/head_without_tp_group"):
        assert "rank 1" in ranks[0][case][0], ranks[0][case][0]
