"""Validity decided together: under tp_group or cp_group a bad input on one rank must make
every rank of the group raise, not leave the others waiting in the next collective until
the process group's timeout (30 minutes by default), nor abort them (gloo's size mismatch).

The public ops run every check that needs no collective first (checks_together's fn), then
one all-gather over each group of a small header: a flag for an error on this rank and the
sizes the ranks must agree on (B and T of the tokens under tp_group, B under cp_group).
When any rank's flag is set or the sizes differ, every rank raises a ValueError that names
the rank and repeats its message (gathered with all_gather_object, on that path only). The
header is 5 float64 numbers per rank (40 bytes): next to the statistics all-gather (24 bytes
per row) it is one more small collective per call (benchmarks/tp_bench.py measures it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .context_parallel import check_group


def groups(**named):
    """{name: group} of the call's group arguments, each checked (None stays None)."""
    return {k: check_group(g, k) for k, g in named.items()}


def agreed_sizes(x):
    """What the ranks of each group must agree on, from the checked LossInputs x (padded
    [S, L] with cu_seqlens): all of [B, T] under tp_group, B under cp_group."""
    return {"tp_group": tuple(x.tokens.shape), "cp_group": (x.tokens.shape[0],)}


def _device(group):
    """Where the header lives: NCCL moves CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def checks_together(groups, fn, sizes=None, *args):
    """fn(*args) (the local checks of a call; no collective inside), decided with every
    rank of each group in ``groups`` (a dict name -> ProcessGroup or None): returns fn's
    result, or raises the same ValueError on every rank when a rank's fn raised (ValueError
    or TypeError) or the ranks' sizes differ. sizes: fn's result -> {group name: tuple of
    ints the ranks of that group must agree on}."""
    live = {k: g for k, g in groups.items() if g is not None}
    if not live:
        return fn(*args)
    try:
        result, error = fn(*args), None
    except (ValueError, TypeError) as e:
        result, error = None, e
    agreed = {} if error is not None or sizes is None else sizes(result)
    for name, group in live.items():
        want = tuple(agreed.get(name, ()))
        header = torch.tensor([float(error is not None), float(len(want)), *map(float, want),
                               *[0.0] * (3 - len(want))], dtype=torch.float64,
                              device=_device(group))
        n = dist.get_world_size(group)
        every = torch.empty(n * header.numel(), dtype=header.dtype, device=header.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(every, header, group=group)
        every = every.view(n, -1).cpu()
        failed = [r for r in range(n) if every[r, 0] > 0]
        if failed:
            messages = [None] * n
            mine = None if error is None else f"{type(error).__name__}: {error}"
            dist.all_gather_object(messages, mine, group=group)
            if error is not None:
                raise error
            r = failed[0]
            raise ValueError(f"rank {r} of {name} (of {n}) rejected its inputs, so this rank "
                             f"stops too: {messages[r]}")
        if len({tuple(row.tolist()) for row in every[:, 1:]}) > 1:
            raise ValueError(
                f"tokens: the ranks of {name} must agree on {_WHAT[name]}; got "
                f"{[tuple(int(v) for v in row[2:2 + int(row[1])]) for row in every]} "
                f"(rank by rank)")
    return result


_WHAT = {"tp_group": "the batch and time sizes [B, T] (each holds all of them, its own "
                     "slice of the vocabulary)",
         "cp_group": "the number of sequences B (each holds its own piece of every one)"}
