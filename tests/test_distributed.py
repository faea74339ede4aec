"""Data, tensor (vocabulary), TP x DP and context parallel on torch.distributed's gloo
backend: 2, 3 and 4 processes (tests/distributed_cases.py), every op against the
single-process result (loss, metrics, every gradient), float32 and bfloat16, uneven
splits. One launch per world size; each check is its own test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import distributed_cases as cases

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch(world, out_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "distributed_cases.py"),
                           "--world", str(world), "--out", str(out_dir)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


@pytest.fixture(scope="module", params=sorted(cases.SUITES))
def world_results(request, tmp_path_factory):
    world = request.param
    return world, _launch(world, tmp_path_factory.mktemp(f"world{world}"))


def test_every_check_within_tolerance(world_results):
    world, results = world_results
    failures = []
    for rank, res in enumerate(results):
        assert res, f"rank {rank} reported no checks"
        for name, val in res.items():
            if isinstance(val, str):
                failures.append(f"rank {rank} {name}: {val[-2000:]}")
            elif not val[0] <= val[1]:
                failures.append(f"rank {rank} {name}: error {val[0]:.3g} > tolerance {val[1]}")
    assert not failures, f"{len(failures)} of {sum(map(len, results))} failed:\n" + \
        "\n".join(failures[:30])


def test_every_suite_ran(world_results):
    """Each suite's checks are present on every rank (a suite that stopped early would
    report fewer)."""
    world, results = world_results
    prefixes = {"tp_checks": "tp/", "dtensor_checks": "dtensor/", "dp_checks": "dp/ppo_loss",
                "dp_from_hidden_checks": "dp/ppo_loss_from_hidden", "cp_checks": "cp/",
                "tp_dp_checks": "tp_x_dp/", "cp_dp_checks": "cp_x_dp/",
                "tp_packed_checks": "tp_packed/", "low_precision_checks": "dp/bfloat16"}
    for fn in cases.SUITES[world]:
        for rank, res in enumerate(results):
            n = sum(k.startswith(prefixes[fn.__name__]) for k in res)
            assert n >= 3, f"world {world}, rank {rank}: {fn.__name__} gave {n} checks"
    # the replicated results of tensor parallel are the same on every rank
    assert len({len(r) for r in results}) == 1


def test_split_is_uneven():
    """The splits the cases use are uneven for 2, 3 and 4 ranks (V = 53, B = 7, T = 9)."""
    for world in (2, 3, 4):
        for n in (53, 7, 9):
            sizes = [b - a for a, b in (cases.split(n, world, r) for r in range(world))]
            assert sum(sizes) == n and min(sizes) >= 1
        assert len({b - a for a, b in (cases.split(53, world, r) for r in range(world))}) > 1
