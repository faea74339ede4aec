"""A check run in a fresh Python process that prints its result as one JSON line.

The lowering tests (test_triton_kernels_lowering.py, test_distill_lowering.py) compile the
Triton kernels for a GPU target without one, which needs triton's real compiler: the
child runs with TRITON_INTERPRET removed (this process set it before triton was imported,
and triton reads it once)."""

import json
import os
import shutil
import subprocess
import sys

MARKER = "@@JSON@@"  # the child's last line starting with it carries the result


def run_child(code, *args, stdin=None, what="child", timeout=600, env=None):
    """Runs ``python -c code *args`` (``stdin``: text, or a value written as JSON, for its
    stdin; ``env``: variables set for the child beside this process's) and returns the JSON
    after the child's last MARKER line; fails with the child's output when there is none."""
    env = {**os.environ, **(env or {})}
    env.pop("TRITON_INTERPRET", None)
    if "TRITON_PTXAS_PATH" not in env and shutil.which("ptxas") is None and \
            os.path.exists("/usr/local/cuda/bin/ptxas"):
        # triton ships a ptxas; this is only a fallback for installs without one
        env["TRITON_PTXAS_PATH"] = "/usr/local/cuda/bin/ptxas"
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)],
                          input=stdin if stdin is None or isinstance(stdin, str)
                          else json.dumps(stdin),
                          capture_output=True, text=True, env=env, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    assert lines, f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(MARKER):])
