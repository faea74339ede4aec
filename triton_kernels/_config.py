"""Launch configurations: autotuned on a GPU, a single small one under the interpreter.

The row kernels stream a row of V logits once (statistics) and, with a gradient, once more
(dlogits); they are bound by memory bandwidth, so the knobs are the vocabulary block
(bytes in flight per program) and the warps that issue it. The configs below suit Hopper
(H100/H200: 228 KiB shared memory per SM, up to 64 warps per SM): blocks of 1-16 Ki
elements, 4-16 warps.

The autotune keys hold V and the kernel flags, never the row count: the block
size fixes the order of a row's reductions, hence its bits, and a row must come out
bitwise the same alone or in any batch (batch invariance). Within a process the first
call's choice for a V is kept for every batch size.

Under TRITON_INTERPRET=1 autotuning would run every config through the (slow) interpreter,
so there is one config, with a block small enough that the test shapes (V = 100, 257)
span several blocks and the last one is partial.
"""

import os

import torch
import triton

# triton.jit decides at decoration time whether it builds an interpreted function; so does
# this module, from the same environment variable.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Block of the vocabulary loop under the interpreter (small: exercises the online merge).
INTERPRET_BLOCK_V = 32
# Chunk of the GAE scan under the interpreter (small: exercises the carry between chunks).
INTERPRET_BLOCK_T = 8

_HOPPER_ROW_CONFIGS = [
    # (BLOCK_V, num_warps). No num_stages: the vocabulary loop has no tl.dot, so triton
    # does not pipeline its loads and the PTX is identical for 1, 2 or 3 stages; the
    # load latency is hidden by occupancy only.
    (1024, 4),
    (2048, 8),
    (4096, 8),
    (4096, 16),
    (8192, 8),
    (8192, 16),
    (16384, 16),
]


def row_configs():
    """Candidate configs of the row kernels (one under the interpreter)."""
    if INTERPRET:
        return [triton.Config({"BLOCK_V": INTERPRET_BLOCK_V}, num_warps=1)]
    return [triton.Config({"BLOCK_V": bv}, num_warps=w) for bv, w in _HOPPER_ROW_CONFIGS]


def prune_row_configs(configs, named_args, **kwargs):
    """Drop blocks far larger than the vocabulary (V = 7 needs no 16 Ki-lane block): cap
    BLOCK_V at next_pow2(V) (at least 128: one warp's worth of 4-wide lanes) and keep one
    config per distinct (block, warps)."""
    if INTERPRET:
        return configs
    cap = max(128, triton.next_power_of_2(int(named_args["V"])))
    seen, out = set(), []
    for c in configs:
        bv = min(c.kwargs["BLOCK_V"], cap)
        warps = max(1, min(c.num_warps, bv // 128))
        if (bv, warps) not in seen:
            seen.add((bv, warps))
            out.append(triton.Config({**c.kwargs, "BLOCK_V": bv}, num_warps=warps))
    return out


# Blocks that hold a whole row in registers (the fused loss's ONE_TILE: one read of the
# logits for both sweeps): only where BLOCK_V >= V (prune_tile_row_configs). On Hopper a
# thread holds up to 255 registers, 64 at 1024 threads; the row is held as float32: 32 Ki
# entries over 16 warps take 128 registers (64 B spilled), over 32 warps 64 (40 B); 64 Ki
# over 32 warps spilled 456 B, so larger rows loop (benchmarks/triton_sass.py, sm_90).
_HOPPER_TILE_CONFIGS = [(32768, 16), (32768, 32)]


# Persistent grids of the fused loss (PERSIST = 1: a program a multiprocessor, each
# looping over rows): with a gradient, a looping block reads its row twice, and the second
# read comes from L2 only while the rows in flight fit there. A program per row keeps as
# many rows in flight as the multiprocessors hold programs (at V = 151936 bf16, 304 KB a
# row, more than an H100 / H200 L2 of 50-60 MB); one a multiprocessor keeps 40 MB (two
# would keep 80). Offered to the autotuner beside the grid of a program per row, for the
# looping blocks of the large rows only (a row above PERSIST_MIN_ROW_BYTES); the same bits
# either way.
_PERSIST = (1,)
PERSIST_MIN_ROW_BYTES = 96 * 1024


def tile_row_configs():
    """row_configs plus the whole-row blocks, each with its ONE_TILE flag (set by
    prune_tile_row_configs from V), and the looping blocks again with each PERSIST of
    _PERSIST (pruned away for small rows). Under the interpreter one config (an autotuner
    of more than one benchmarks them even where the pruning leaves one: triton 3.6), which
    the launcher does not use: it launches the plain kernel with inplace_tile_row_config(V),
    a loop where V > INTERPRET_BLOCK_V and one tile where not."""
    if INTERPRET:
        return [triton.Config({"BLOCK_V": INTERPRET_BLOCK_V, "ONE_TILE": False, "PERSIST": 0},
                              num_warps=1)]
    plain = [triton.Config({"BLOCK_V": bv, "ONE_TILE": False, "PERSIST": 0}, num_warps=w)
             for bv, w in _HOPPER_ROW_CONFIGS + _HOPPER_TILE_CONFIGS]
    persist = [triton.Config({"BLOCK_V": bv, "ONE_TILE": False, "PERSIST": k}, num_warps=w)
               for bv, w in _HOPPER_ROW_CONFIGS if bv >= 4096 for k in _PERSIST]
    return plain + persist


def prune_tile_row_configs(configs, named_args, **kwargs):
    """prune_row_configs for tile_row_configs: ONE_TILE where the (capped) block holds the
    row; the whole-row blocks (sized to hold a row, not to loop) only where they do; the
    persistent grids only for rows above PERSIST_MIN_ROW_BYTES (the logits' element size
    from named_args' logits_ptr, 2 bytes where absent)."""
    if INTERPRET:
        return configs
    V = int(named_args["V"])
    x = named_args.get("logits_ptr")
    size = x.element_size() if hasattr(x, "element_size") else 2
    big = V * size > PERSIST_MIN_ROW_BYTES
    loops = {bv for bv, _ in _HOPPER_ROW_CONFIGS}
    keep = [c for c in configs if (c.kwargs["BLOCK_V"] in loops or c.kwargs["BLOCK_V"] >= V)
            and (big or not c.kwargs.get("PERSIST", 0))]
    out = []
    # (prune_row_configs keeps one config per (block, warps): per PERSIST value)
    for persist in sorted({c.kwargs.get("PERSIST", 0) for c in keep}):
        for c in prune_row_configs([c for c in keep if c.kwargs.get("PERSIST", 0) == persist],
                                   named_args):
            c.kwargs["ONE_TILE"] = c.kwargs["BLOCK_V"] >= V
            if not (c.kwargs["ONE_TILE"] and persist):  # (a row in registers is read once)
                out.append(c)
    return out


def sm_count(device):
    """Multiprocessors of a CUDA device (1 for the interpreter's CPU tensors)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_grid(rows, device, meta_or_launch):
    """The fused loss's grid: a program per row, or (PERSIST = k) k programs a
    multiprocessor of the device (sm_count), at most one a row. meta_or_launch: the launch
    options, or {} for the autotuner's: then a function of its META (triton calls it with
    each config's). torch.sym_min: no guard on a symbolic row count under torch.compile."""
    def grid(meta):
        k = int(meta.get("PERSIST", 0) or 0)
        if not k:
            return (rows,)
        return (torch.sym_max(1, torch.sym_min(rows, k * sm_count(device))),)
    if meta_or_launch:
        return grid(meta_or_launch)
    return grid


def inplace_tile_row_config(V):
    """inplace_row_config with the fused loss's ONE_TILE flag (a program per row)."""
    cfg = inplace_row_config(V)
    return {**cfg, "ONE_TILE": cfg["BLOCK_V"] >= int(V), "PERSIST": 0}


def inplace_row_config(V):
    """Launch options of the kernels that write their input in place (the in-place loss,
    scale_grad_), which are not autotuned (their trials would overwrite the data): a mid
    config of the list above, the block capped near V."""
    if INTERPRET:
        return {"BLOCK_V": INTERPRET_BLOCK_V, "num_warps": 1}
    bv = min(4096, max(128, triton.next_power_of_2(int(V))))
    return {"BLOCK_V": bv, "num_warps": max(1, min(8, bv // 128))}


def gae_block_t(T):
    """Chunk length of the GAE scan: the whole row up to 1024 positions, then chunks."""
    if INTERPRET:
        return INTERPRET_BLOCK_T
    return max(16, min(1024, triton.next_power_of_2(max(int(T), 1))))


def wrap(kernel):
    """torch.library.wrap_triton(kernel), except for a kernel the interpreter runs (an
    InterpretedFunction, or an autotuner around one), which is returned as it is: torch
    2.14's wrap_triton does the same, while up to torch 2.11 wrap_triton raises
    "wrap_triton only works on functions annotated with triton.jit or triton.autotune" for a
    plain @triton.jit kernel under TRITON_INTERPRET=1 (triton.jit returns an
    InterpretedFunction there, not a JITFunction), and wraps an interpreted autotuner in a
    TraceableTritonKernelWrapper that lacks the JIT metadata it needs. Launch sites call
    wrap(k)[grid](...) wherever they would call wrap_triton(k)[grid](...)."""
    if INTERPRET and _interpreted(kernel):
        return kernel
    from torch.library import wrap_triton
    return wrap_triton(kernel)


def _interpreted(kernel):
    try:
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    for _ in range(8):  # an autotuner / heuristics chain around the function
        if not isinstance(kernel, (Autotuner, Heuristics)):
            break
        kernel = kernel.fn
    return isinstance(kernel, InterpretedFunction)
