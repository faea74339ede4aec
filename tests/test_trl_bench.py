"""Smoke test of benchmarks/trl_bench.py --quick (stock trl.GRPOTrainer against
FusedGRPOTrainer, one dapo loss step on a tiny model): the table lists both variants and
the two trainers' losses agree. No timing or memory figure is asserted."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^(dapo|grpo-kl)\s+V=(\d+) (\d+)x(\d+)\s+(stock|fused)\s+([\d.]+)\s+([\d.]+)")
LOSS = re.compile(r"^loss stock (\S+) fused (\S+) rel diff (\S+)")


def test_quick_table():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trl_bench.py"), "--quick"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    rows = [m.groups() for m in map(ROW.match, lines) if m]
    have = {(case, variant) for case, *_, variant, _, _ in rows}
    assert have == {("dapo", "stock"), ("dapo", "fused")}, run.stdout
    for *_, ms, mib in rows:
        assert float(ms) > 0 and float(mib) >= 0
    losses = [m.groups() for m in map(LOSS.match, lines) if m]
    assert len(losses) == 1, run.stdout
    for stock, fused, rel in losses:
        assert float(stock) == pytest.approx(float(fused), rel=1e-5, abs=1e-7)
        assert float(rel) <= 1e-5
