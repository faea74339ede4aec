"""The measuring code the benchmarks share (cpu_bench.py, from_hidden_bench.py, report.py,
distill_bench.py, replay_bench.py, trl_bench.py, verl_bench.py): median wall times, the copy
floor and the peak extra memory of one step. It lives in the package now
(ppo_kernels/bench.py, the `ppo-kernels-bench` entry point); this module re-exports it.

CPU: wall time from time.perf_counter (seconds); peak memory from Linux's VmHWM (reset
through /proc/self/clear_refs) minus VmRSS before the step, in bytes. CUDA: CUDA events
around each call after an L2 flush (seconds), torch.cuda.max_memory_allocated minus the
memory allocated before the step (bytes).

MMAP_ENV and reexec_with are defined here as well, without importing torch, so that
report.py can restart itself with glibc's mmap threshold before torch loads; the rest is
imported from the package on first use.
"""

from __future__ import annotations

import os
import sys

# glibc serves every allocation above 128 KiB from its own mmap and unmaps it on free, so
# freed [N, V] buffers leave the RSS instead of being reused unseen by a later step (the
# threshold must be in the environment when the process starts); the same as
# ppo_kernels.bench.MMAP_ENV
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}

_FROM_PACKAGE = ("status_kb", "median_s", "wall_times_s", "peak_extra_bytes", "child_peak",
                 "CopyFloor", "CpuMeter", "CudaMeter")


def reexec_with(env_extra):
    """Restarts this script with env_extra in its environment unless it is there already
    (glibc reads MALLOC_* only at start-up)."""
    if all(os.environ.get(k) == v for k, v in env_extra.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, **env_extra))


def __getattr__(name):
    if name in _FROM_PACKAGE:
        from ppo_kernels import bench

        return getattr(bench, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
