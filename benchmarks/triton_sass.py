"""Instructions per element, block barriers and registers of the Triton row kernels' hot
loops, compiled for sm_90 without a GPU (triton.compile for GPUTarget("cuda", 90, 32), the
cubin disassembled with cuobjdump -sass): the Triton half of benchmarks/cuda_sass.py.

    python benchmarks/triton_sass.py [--dtype bf16] [--configs 4096:8,16384:16,32768:16]
    python benchmarks/triton_sass.py --threshold [--dtype bf16]   # the radix select's sweeps

For each kernel and launch config (BLOCK_V:num_warps[:1], the knobs of
triton_kernels/_config.py; :1 the fused loss's ONE_TILE) it prints the registers per
thread, the stack bytes (spills), and each hot loop (a backward branch's span holding
MUFU.EX2: one exp per logit of the vocabulary sweeps) as instructions per exp and the
BAR.SYNC it executes per BLOCK_V entries. A
kernel whose row fits one block (ONE_TILE) has no vocabulary loop: its straight-line
sweeps are counted over the whole function instead ("whole kernel": both sweeps, the
token's epilogue and the stores, over the row's entries per thread). Static counts: what a sweep
issues per element, not a time. Row pointers, strides and V are declared 16-byte aligned,
as the runtime specialises them for V = 32768 or 151936.

Runs triton's compiler, so TRITON_INTERPRET must be unset (this script removes it).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import cuda_sass  # noqa: E402

LOGITS = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
# name: (module, kernel attribute, constexprs beside ACC and BLOCK_V): the fused loss as
# the default options launch it, the forward-only statistics, the gradient of the two-phase
# path
KERNELS = {
    "ppo_loss (fwd+grad)": ("ppo_loss", "_ppo_loss_jit",
                            dict(KL_EST=2, HAS_REF=False, HAS_ISW=False, HAS_DUAL=False,
                                 HAS_OLD=True, HAS_WENT=False, POLICY_LOSS=0, KL_BIAS=False,
                                 COMPUTE_GRAD=True, ROW_TEMP=False, PERSIST=0)),
    "token_logprobs fwd": ("logprobs", "logprobs_fwd_kernel",
                           dict(NEED_ENT=True, SCORE=False, KL_EST=0, ROW_TEMP=False)),
    "token_logprobs bwd": ("logprobs", "_logprobs_bwd_kernel",
                           dict(HAS_GENT=True, ROW_TEMP=False)),
}


def types(dtype):
    a = "*fp32"
    t = {"logits_ptr": LOGITS[dtype], "grad_ptr": LOGITS[dtype], "tokens_ptr": "*i64",
         "mask_ptr": "*i1", "T": "i32", "TL": "i32", "TG": "i32", "V": "i32", "ROWS": "i32"}
    for n in ("stride_lb", "stride_lt", "stride_gb", "stride_gt"):
        t[n] = "i64"
    for n in ("logp_ptr", "ent_ptr", "max_ptr", "lsum_ptr", "ref_ptr", "kl_ptr", "rew_ptr",
              "glogp_ptr", "gent_ptr", "old_ptr", "adv_ptr", "w_ptr", "isw_ptr", "went_ptr",
              "loss_tok_ptr", "invt_ptr"):
        t[n] = a
    return t


def jit_of(kernel):
    """The JITFunction under autotuner / heuristics wrappers."""
    while not isinstance(kernel, triton.runtime.jit.JITFunction):
        kernel = kernel.fn
    return kernel


def compile_kernel(modname, attr, consts, dtype, block_v, warps, one_tile=False):
    import importlib
    mod = importlib.import_module("ppo_kernels.triton_kernels." + modname)
    fn = jit_of(getattr(mod, attr))
    consts = dict(consts, ACC=tl.float32, BLOCK_V=block_v, ONE_TILE=one_tile)
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    return compile_sm90(fn, consts, types(dtype), warps)


def compile_sm90(fn, consts, ty, warps):
    """triton.compile of the JITFunction fn for sm_90: consts its constexprs, ty the other
    arguments' types (unlisted: fp64), pointers, strides and V declared 16-byte aligned."""
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        else:
            sig[n] = ty.get(n, "fp64")  # (the float options: float64 by annotation)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n.startswith("stride")
                                     or n == "V")}
    ckeys = {(fn.arg_names.index(n),): v for n, v in consts.items()}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=ckeys, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def dump(k, flag):
    """cuobjdump FLAG (-sass, -res-usage) of the kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        return subprocess.run([cuda_sass.cuobjdump(), flag, f.name], capture_output=True,
                              text=True, check=True).stdout


def resources(k):
    """(registers per thread, stack bytes per thread: spills) from cuobjdump -res-usage."""
    text = dump(k, "-res-usage")
    reg = re.search(r"REG:(\d+)", text)
    stack = re.search(r"STACK:(\d+)", text)
    return int(reg.group(1)), int(stack.group(1))


def loops(body):
    """[(exp count, instructions, barriers, whole)] of the innermost loops (no loop inside:
    the vocabulary sweeps, not the loop over a program's rows around them) holding at
    least 4 MUFU.EX2, or of the whole function (whole True) where it has none."""
    out = set()
    for _, seg in innermost_loops(body):
        ex = sum("MUFU.EX2" in x for x in seg)
        if ex >= 4:
            out.add((ex, len(seg), sum(x.startswith("BAR") for x in seg), False))
    if not out:
        seg = [x for _, x in body if not x.startswith("NOP")]
        out.add((sum("MUFU.EX2" in x for x in seg), len(seg),
                 sum(x.startswith("BAR") for x in seg), True))
    return sorted(out, key=lambda lp: -lp[0])


def innermost_loops(body):
    """[(first address, instructions)] of the innermost loops (backward branches' spans
    holding no other), NOPs left out, in address order."""
    spans = []
    for addr, ins in body:
        target = ins.split()[-1] if "BRA" in ins else ""
        try:
            start = int(target, 16)
        except ValueError:
            continue
        if start < addr:
            spans.append((start, addr))
    return [(start, [x for a, x in body if start <= a <= addr and not x.startswith("NOP")])
            for start, addr in sorted(spans)
            if not any(start <= s and e <= addr and (s, e) != (start, addr) for s, e in spans)]


def threshold_counts(dtype):
    """The re-derived kept sets' radix select (triton_kernels/threshold.py) with top_p
    alone and with top_k alone: each innermost sweep's instructions per entry (a thread
    takes BLOCK / (32 num_warps) entries per iteration). Its loops hold no MUFU.EX2 (the
    masses' exp is float64), so they are told apart by address: the max / min sweep
    first, the radix passes, the single-key sweep last."""
    from ppo_kernels.triton_kernels import threshold as th
    fn = jit_of(th._threshold_kernel)
    kb = {"fp32": 32, "bf16": 16, "fp16": 16}[dtype]
    ty = {"logits_ptr": LOGITS[dtype], "mask_ptr": "*i1", "topk_ptr": "*i64",
          "topp_ptr": "*fp64", "minp_ptr": "*fp64", "temps_ptr": "*fp64",
          "out_ptr": "*fp64", "stride_lb": "i64", "stride_lt": "i64", "T": "i32",
          "V": "i32"}
    per_thread = th.BLOCK // (32 * th.NUM_WARPS)
    for rule in ("top_p", "top_k"):
        consts = dict(HAS_K=rule == "top_k", HAS_P=rule == "top_p", HAS_MINP=False,
                      ROW_TEMP=False, KEY_BITS=kb, RADIX_BITS=4, BLOCK=th.BLOCK)
        k = compile_sm90(fn, consts, ty, th.NUM_WARPS)
        body = next(iter(cuda_sass.functions(dump(k, "-sass")).values()))
        regs, spill = resources(k)
        for start, seg in innermost_loops(body):
            print(f"threshold {rule:5s} {dtype} BLOCK {th.BLOCK} warps {th.NUM_WARPS}: "
                  f"{regs:3d} regs, {spill:4d} B spilled; loop at {start:#06x} of "
                  f"{len(seg):4d} instructions ({len(seg) / per_thread:5.1f} per entry), "
                  f"{sum(x.startswith('BAR') for x in seg):2d} BAR, "
                  f"{sum('SHFL' in x for x in seg):3d} SHFL")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=sorted(LOGITS))
    ap.add_argument("--configs", default="4096:8,16384:16,32768:16:1,32768:32:1",
                    help="BLOCK_V:num_warps[:1 for the fused loss's ONE_TILE, the row "
                         "whole in registers], comma-separated")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--threshold", action="store_true",
                    help="The re-derived kept sets' radix select instead (its sweeps).")
    a = ap.parse_args(argv)
    if cuda_sass.cuobjdump() is None:
        print("no cuobjdump (triton's bundled copy or CUDA's)", file=sys.stderr)
        return 1
    if a.threshold:
        threshold_counts(a.dtype)
        return 0
    for name in a.kernels.split(","):
        modname, attr, consts = KERNELS[name]
        for cfg in a.configs.split(","):
            bv, w, *tile = (int(x) for x in cfg.split(":"))
            one = bool(tile and tile[0])
            if one and attr != "_ppo_loss_jit":
                continue
            k = compile_kernel(modname, attr, consts, a.dtype, bv, w, one)
            body = next(iter(cuda_sass.functions(dump(k, "-sass")).values()))
            regs, spill = resources(k)
            for ex, n, bars, whole in loops(body):
                head = (f"{name:20s} {a.dtype} BLOCK_V {bv:6d}{' tile' if one else '     '} "
                        f"warps {w:2d}: {regs:3d} regs, {spill:4d} B spilled; ")
                if whole:  # (the row's entries per thread: both sweeps and the epilogue)
                    per = n / (bv / (32 * w))
                    print(head + f"whole kernel {n:5d} instructions, {ex:4d} exp "
                          f"({per:5.1f} per element, both sweeps), {bars:2d} BAR")
                else:
                    print(head + f"loop of {n:5d} instructions, {ex:4d} exp "
                          f"({n / ex:5.1f} per element), {bars:2d} BAR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
