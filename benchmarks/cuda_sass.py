"""Instructions per element of the CUDA row kernels' hot loops, read off the sm_90 SASS of
the build (no GPU needed): csrc/cuda/NOTES.md's figures.

    python benchmarks/cuda_sass.py [OBJECT.o ...]

Without arguments it reads the CUDA units of the editable build (build/*/cuda_units/*.o,
`make setup` with nvcc). cuobjdump is taken from PATH, CUDA_HOME, or the copy that triton
bundles. A loop is the span from a backward branch's target to the branch; each row
kernel's loops with the most MUFU.EX2 (one exp2 per logit: the vocabulary sweeps) are
printed with their instruction count over that exp2 count. The re-derived threshold's
kernel (threshold_select_kernel, csrc/cuda/threshold_select.cuh) has no exp per element: its
sweeps are the loops with shared-memory atomics (ATOMS, one per entry counted), printed over
that count; threshold_kept_kernel's (the same select, then the kept statistics' sweep)
are its loops with an exp a kept entry. Static counts: what the sweep issues per element,
not a time.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = ("partial_stats_kernel", "grad_chunks_kernel", "fused_rows_kernel",
           "cluster_rows_kernel", "threshold_select_kernel", "threshold_kept_kernel")
# the per-element instruction of each kernel's sweeps (threshold: the bin counts)
PER = {"threshold_select_kernel": "ATOMS"}
DTYPES = {"N3c108BFloat16E": "bf16", "fE": "float32", "NS_6select8Bf16BitsE": "bf16",
          "NS_6select8HalfBitsE": "float16"}


def cuobjdump():
    """The cuobjdump to run, or None."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if os.path.exists(os.path.join(home, "bin", "cuobjdump")):
        return os.path.join(home, "bin", "cuobjdump")
    try:
        import triton  # noqa: F401 (its NVIDIA backend ships one)
        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "cuobjdump")
        return path if os.path.exists(path) else None
    except ImportError:
        return None


def functions(sass):
    """{mangled name: [(address, instruction)]} of a cuobjdump -sass listing (the first
    copy of each function)."""
    out, name, body = {}, None, []
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            if name and name not in out:
                out[name] = body
            name, body = m.group(1), []
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if name and m:
            body.append((int(m.group(1), 16), m.group(2).strip()))
    if name and name not in out:
        out[name] = body
    return out


def hot_loops(body, top=6, per="MUFU.EX2"):
    """[(count of `per`, instructions)] of the innermost loops (no loop inside: the sweeps,
    not the loop over a block's rows around them) with the most of `per` (one a logit: an
    exp2, or a bin count), NOPs left out."""
    spans = []
    for addr, ins in body:
        m = re.search(r"BRA\s+.*?(0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            spans.append((int(m.group(1), 16), addr))
    loops = set()
    for start, addr in spans:
        if not any(start <= s and e <= addr and (s, e) != (start, addr) for s, e in spans):
            seg = [x for a, x in body if start <= a <= addr and not x.startswith("NOP")]
            ex = sum(per in x for x in seg)
            if ex >= 4:
                loops.add((ex, len(seg)))
    return sorted(loops, key=lambda lp: (-lp[0], lp[1]))[:top]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("objects", nargs="*", help="CUDA object files (default: the build's units)")
    a = ap.parse_args(argv)
    objects = a.objects or sorted(glob.glob(os.path.join(ROOT, "build", "*", "temp", "_C",
                                                         "**", "cuda_units", "*.o"),
                                            recursive=True))
    tool = cuobjdump()
    if not objects or tool is None:
        print("no CUDA objects (build with nvcc: make setup) or no cuobjdump", file=sys.stderr)
        return 1
    seen = set()
    for obj in objects:
        sass = subprocess.run([tool, "-sass", obj], capture_output=True, text=True,
                              check=True).stdout
        for name, body in sorted(functions(sass).items()):
            kernel = next((k for k in KERNELS if k in name), None)
            dtype = next((d for tag, d in DTYPES.items() if f"{kernel}I{tag}" in name), None)
            if kernel is None or dtype is None or (kernel, dtype) in seen:
                continue
            seen.add((kernel, dtype))
            per = PER.get(kernel, "MUFU.EX2")
            for ex, n in hot_loops(body, per=per):
                what = "exp2" if per == "MUFU.EX2" else "atoms"
                print(f"{kernel:23s} {dtype:8s} loop of {n:5d} instructions, {ex:3d} {what}: "
                      f"{n / ex:5.1f} per element")
    return 0


if __name__ == "__main__":
    sys.exit(main())
