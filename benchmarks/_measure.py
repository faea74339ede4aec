"""The measuring code the benchmarks share (cpu_bench.py, from_hidden_bench.py, report.py):
median wall times, the copy floor and the peak extra memory of one step.

CPU: wall time from time.perf_counter (seconds); peak memory from Linux's VmHWM (reset
through /proc/self/clear_refs) minus VmRSS before the step, in bytes. CUDA: CUDA events
around each call after an L2 flush (seconds), torch.cuda.max_memory_allocated minus the
memory allocated before the step (bytes).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

# glibc serves every allocation above 128 KiB from its own mmap and unmaps it on free, so
# freed [N, V] buffers leave the RSS instead of being reused unseen by a later step (the
# threshold must be in the environment when the process starts)
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def status_kb(key):
    """A field of /proc/self/status in KiB (VmRSS:, VmHWM:)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def median_s(step, prepare=None, reps=5, warmup=2):
    """Median wall time in seconds of step(prepare()) (step() without prepare) over reps
    calls, after warmup untimed ones; prepare's work is not timed."""
    for _ in range(warmup):
        step(prepare()) if prepare else step()
    times = []
    for _ in range(reps):
        ready = prepare() if prepare else None
        t0 = time.perf_counter()
        step(ready) if prepare else step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_extra_bytes(run):
    """Peak resident bytes above the current RSS while run() runs (what it returns is dropped
    inside the window, so its outputs count)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = status_kb("VmRSS:")
    run()
    # (>= 0: a step that allocates nothing large can end a few pages below the base)
    return max(0, status_kb("VmHWM:") - base) * 1024


def child_peak(args, env_extra=None):
    """Runs `python args...` (a script's --peak-of mode) in a fresh process; returns the
    integer (bytes) it printed last."""
    env = dict(os.environ, **env_extra) if env_extra else None
    out = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                         check=True, env=env)
    return int(out.stdout.strip().splitlines()[-1])


def reexec_with(env_extra):
    """Restarts this script with env_extra in its environment unless it is there already
    (glibc reads MALLOC_* only at start-up)."""
    if all(os.environ.get(k) == v for k, v in env_extra.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, **env_extra))


class CopyFloor:
    """Not a loss: the read + write of x that every forward+backward over x needs,
    x copied into a buffer of its size allocated and touched on first use (mapped memory)."""

    def __init__(self):
        self.out = {}

    def map(self, x):
        """Allocates (and touches) the output buffer for x's shape and dtype now."""
        self.out[(x.shape, x.dtype, x.device)] = x.new_zeros(x.shape)

    def __call__(self, x):
        key = (x.shape, x.dtype, x.device)
        if key not in self.out:
            self.map(x)
        return self.out[key].copy_(x)

    def clear(self):
        self.out.clear()


class CpuMeter:
    """Times in seconds (perf_counter), peaks in bytes (VmHWM)."""

    name = "cpu"

    def median_s(self, step, prepare=None, reps=5, warmup=1):
        return median_s(step, prepare, reps, warmup)

    def peak_extra_bytes(self, run):
        return peak_extra_bytes(run)


class CudaMeter:
    """Times in seconds from CUDA events (an L2 flush before every timed call, outside the
    timed region, so each call starts cold), peaks in bytes from max_memory_allocated."""

    name = "cuda"

    def __init__(self, flush_mib=256):
        import torch  # (here, not at the top: report.py re-executes itself before torch loads)

        self.torch = torch
        self.flush = torch.empty(flush_mib * 2**20, dtype=torch.uint8, device="cuda")

    def median_s(self, step, prepare=None, reps=5, warmup=1):
        for _ in range(warmup):
            step(prepare()) if prepare else step()
        torch = self.torch
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            ready = prepare() if prepare else None
            self.flush.zero_()
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            step(ready) if prepare else step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def peak_extra_bytes(self, run):
        torch = self.torch
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
