"""Smoke test of the benchmark report (benchmarks/report.py --quick into a tmp folder, a grid
of `ppo_kernels.bench.run` calls): the CSV's columns and rows, the entry point's agreement
check, and that the PNGs are valid images. No timing is asserted."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from report import COLUMNS, OPS  # noqa: E402

QUICK_N, QUICK_V, DTYPES = (32, 64), 512, ("float32", "bfloat16")  # report.py's --quick


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    with open(out / "cpu_report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return out, run, rows


def test_csv_columns_and_values(report):
    _, _, rows = report
    assert rows and list(rows[0]) == COLUMNS
    for r in rows:
        assert 0 < float(r["min_ms"]) <= float(r["median_ms"]) <= float(r["max_ms"]), r
        assert float(r["peak_extra_mib"]) >= 0, r
        assert int(r["reps"]) == 1, r  # --quick: one timed call
        if r["backend"] == "cpu":
            assert float(r["vs_fused"]) == pytest.approx(1.0, rel=1e-3)
        if r["backend"] == "floor":
            assert float(r["vs_floor"]) == pytest.approx(1.0, rel=1e-3)
        assert float(r["vs_floor"]) > 0 and float(r["vs_fused"]) > 0, r


def test_csv_rows_cover_the_grid(report):
    _, _, rows = report
    have = {(r["op"], r["backend"], int(r["N"]), r["V"], r["dtype"]) for r in rows}
    assert {r["op"] for r in rows} == set(OPS)
    every = ("cpu", "plain composite", "eager composite", "floor")
    for n in QUICK_N:
        for d in DTYPES:
            for op in set(OPS) - {"gae"}:
                for be in every:
                    assert (op, be, n, str(QUICK_V), d) in have, (op, be, n, d)
            for op in ("token_logprobs", "ppo_loss", "ppo_loss_gspo", "ppo_loss_from_hidden"):
                assert (op, "F.cross_entropy", n, str(QUICK_V), d) in have
            assert ("ppo_loss_from_hidden", "cpu, materialised", n, str(QUICK_V), d) in have
        for be in every:  # gae: float32 [B, T], no V
            assert ("gae", be, n, "", "float32") in have
    # --quick compiles at the base point (N=64) in float32 only
    compiled = {(r["op"], int(r["N"]), r["dtype"]) for r in rows if r["backend"] == "torch.compile"}
    assert compiled == {(op, 64, "float32") for op in OPS}
    h = {r["H"] for r in rows if r["op"] == "ppo_loss_from_hidden"}
    assert h == {"32"} and {r["H"] for r in rows if r["op"] != "ppo_loss_from_hidden"} == {""}


def test_variants_agree_and_pngs_are_images(report):
    out, run, _ = report
    assert "WARNING" not in run.stderr  # every row agrees with the fused op (bench's check)
    import matplotlib.image

    for name in ("cpu_time.png", "cpu_memory.png", "cpu_vocab.png"):
        path = out / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(path)
        assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 300
