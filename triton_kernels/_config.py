"""Launch configurations: autotuned on a GPU, a single small one under the interpreter.

The row kernels stream a row of V logits once (statistics) and, with a gradient, once more
(dlogits); they are bound by memory bandwidth, so the knobs are the vocabulary block
(bytes in flight per program), the warps that issue it, and the software-pipelining depth
of the block loop. The configs below suit Hopper (H100/H200: 228 KiB shared memory per SM,
up to 64 warps per SM): blocks of 2-16 Ki elements, 4-16 warps, 1-3 stages.

Under TRITON_INTERPRET=1 autotuning would run every config through the (slow) interpreter,
so there is one config, with a block small enough that the test shapes (V = 100, 257)
span several blocks and the last one is partial.
"""

import os

import triton

# triton.jit decides at decoration time whether it builds an interpreted function; so does
# this module, from the same environment variable.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Block of the vocabulary loop under the interpreter (small: exercises the online merge).
INTERPRET_BLOCK_V = 32
# Chunk of the GAE scan under the interpreter (small: exercises the carry between chunks).
INTERPRET_BLOCK_T = 8

_HOPPER_ROW_CONFIGS = [
    # (BLOCK_V, num_warps, num_stages)
    (1024, 4, 2),
    (2048, 8, 2),
    (4096, 8, 2),
    (4096, 16, 3),
    (8192, 16, 2),
    (8192, 8, 1),
    (16384, 16, 1),
]


def row_configs():
    """Candidate configs of the row kernels (one under the interpreter)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_V": INTERPRET_BLOCK_V}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_V": bv}, num_warps=w, num_stages=s)
            for bv, w, s in _HOPPER_ROW_CONFIGS]


def prune_row_configs(configs, named_args, **kwargs):
    """Drop blocks far larger than the vocabulary (V = 7 needs no 16 Ki-lane block): cap
    BLOCK_V at next_pow2(V) (at least 128: one warp's worth of 4-wide lanes) and keep one
    config per distinct (block, warps, stages)."""
    if INTERPRET:
        return configs
    cap = max(128, triton.next_power_of_2(int(named_args["V"])))
    seen, out = set(), []
    for c in configs:
        bv = min(c.kwargs["BLOCK_V"], cap)
        warps = max(1, min(c.num_warps, bv // 128))
        key = (bv, warps, c.num_stages)
        if key not in seen:
            seen.add(key)
            out.append(triton.Config({**c.kwargs, "BLOCK_V": bv}, num_warps=warps,
                                     num_stages=c.num_stages))
    return out


def inplace_row_config(V):
    """Launch options of the in-place loss kernel, which is not autotuned (its trials would
    overwrite the logits): a mid config of the list above, the block capped near V."""
    if INTERPRET:
        return {"BLOCK_V": INTERPRET_BLOCK_V, "num_warps": 1, "num_stages": 1}
    bv = min(4096, max(128, triton.next_power_of_2(int(V))))
    return {"BLOCK_V": bv, "num_warps": max(1, min(8, bv // 128)), "num_stages": 2}


def gae_block_t(T):
    """Chunk length of the GAE scan: the whole row up to 1024 positions, then chunks."""
    if INTERPRET:
        return INTERPRET_BLOCK_T
    return max(16, min(1024, triton.next_power_of_2(max(int(T), 1))))
