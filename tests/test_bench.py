"""The benchmark entry point (ppo_kernels/bench.py) on tiny shapes: it runs for several ops,
reports the agreement check and writes the JSON / CSV fields docs/BENCHMARKING.md lists.
No time is asserted (timings are not tests)."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from ppo_kernels import bench

TINY = ["--B", "2", "--T", "8", "--V", "64", "--H", "16", "--reps", "1", "--warmup", "0",
        "--no-compile", "--no-memory", "--quiet"]
ROW_FIELDS = {"variant", "kind", "min_ms", "median_ms", "max_ms", "reps", "peak_extra_bytes",
              "vs"}


def run_json(tmp_path, *args):
    path = tmp_path / "out.json"
    res = bench.run([*TINY, *args, "--json", str(path)])
    with open(path) as f:
        data = json.load(f)
    assert data["op"] == res["op"]
    return data


@pytest.mark.parametrize("op, args, baselines", [
    ("ppo_loss", ["--opt", "kl_coef=0.05", "--opt", "kl_estimator=k3", "--opt",
                  "entropy_coef=0.01", "--opt", "dual_clip_c=3"],
     {"plain composite", "F.cross_entropy", "eager composite"}),
    ("ppo_loss", ["--opt", "policy_loss=gspo"], {"plain composite", "eager composite"}),
    ("ppo_loss_from_hidden", [], {"plain composite", "eager composite", "materialised"}),
    ("token_logprobs", ["--opt", "return_entropy=true"], {"plain composite"}),
    ("score_rollout", [], {"plain composite", "eager composite"}),
    ("gae", [], {"plain composite", "eager composite"}),
    ("distill_loss", ["--teacher-k", "4"], {"plain composite", "eager composite"}),
    ("ppo_loss", ["--opt", "top_k=8", "--opt", "top_p=0.9"], {"eager composite"}),
    # the options that read the inference engine's log-probs get the benchmark's own
    ("ppo_loss", ["--opt", "rollout_correction=tis"], {"eager composite"}),
    ("ppo_loss_from_hidden", ["--opt", "rollout_correction=mis-seq", "--opt",
                              "off_policy_mask_threshold=0.5"],
     {"eager composite", "materialised"}),
])
def test_ops_json(tmp_path, op, args, baselines):
    data = run_json(tmp_path, "--op", op, *args)
    assert data["all_agree"] is True
    (point,) = data["points"]
    assert (point["B"], point["T"], point["V"], point["N"]) == (2, 8, 64, 16)
    assert baselines <= set(point["agreement"])
    for d in point["agreement"].values():
        assert d["agrees"] is True and d["value_max_abs_diff"] is not None
    assert "torch.compile" in point["skipped"] and "liger" in point["skipped"]
    want_modes = ["fwd"] if op in bench.NO_BACKWARD else ["fwd", "fwd+bwd"]
    assert list(point["modes"]) == want_modes == data["modes"]
    for rows in point["modes"].values():
        names = [r["variant"] for r in rows]
        assert names[0] == "fused" and "floor" in names and baselines <= set(names)
        # the cross-entropy yardstick: timed where the op reads logits, never compared
        assert ("cross-entropy loss" in names) == (op in ("ppo_loss", "token_logprobs"))
        assert "cross-entropy loss" not in point["agreement"]
        for r in rows:
            assert ROW_FIELDS <= set(r) and r["reps"] == 1
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
            assert r["peak_extra_bytes"] is None  # (--no-memory)


def test_options_header_and_csv(tmp_path, capsys):
    cfg = tmp_path / "loss.yaml"
    cfg.write_text("kl_coef: 0.05\nkl_estimator: k3\n")
    path = tmp_path / "out.csv"
    res = bench.run([*TINY[:-1], "--config", str(cfg), "--opt", "entropy_coef=0.01",
                     "--mode", "fwd", "--V", "32,64", "--csv", str(path)])
    out = capsys.readouterr().out
    assert "options: kl_coef=0.05 kl_estimator=k3 entropy_coef=0.01" in out
    assert "agreement with the fused output" in out and "plain composite" in out
    assert res["options"] == {"kl_coef": 0.05, "kl_estimator": "k3", "entropy_coef": 0.01}
    assert [p["V"] for p in res["points"]] == [32, 64]
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert {r["V"] for r in rows} == {"32", "64"} and {r["mode"] for r in rows} == {"fwd"}
    assert {"fused", "plain composite", "floor"} <= {r["variant"] for r in rows}


def test_extra_rows_and_disagreement_flag(tmp_path):
    data = run_json(tmp_path, "--mode", "fwd+bwd",
                    "--extra", "inplace:inplace_backward=true",
                    "--extra", "scaled:grad_scale=1/3,backward_scale=1/3",
                    "--extra", "gspo:policy_loss=gspo")
    agree = data["points"][0]["agreement"]
    assert agree["inplace"]["agrees"] and agree["scaled"]["agrees"]
    assert "gspo" not in agree  # other loss options: timed, not compared
    assert "gspo" in [r["variant"] for r in data["points"][0]["modes"]["fwd+bwd"]]


def test_parse_value():
    assert bench.parse_value("0.05") == 0.05 and bench.parse_value("k3") == "k3"
    assert bench.parse_value("true") is True and bench.parse_value("None") is None
    assert bench.parse_value("1/3") == 1 / 3


def test_module_entry_point(tmp_path):
    """python -m ppo_kernels.bench, as a user runs it (the re-exec with the mmap threshold
    included)."""
    path = tmp_path / "out.json"
    out = subprocess.run([sys.executable, "-m", "ppo_kernels.bench", *TINY[:-1],
                          "--mode", "fwd", "--json", str(path)],
                         capture_output=True, text=True, check=True, timeout=600)
    assert "agreement with the fused output" in out.stdout and "median ms" in out.stdout
    data = json.loads(path.read_text())
    assert data["points"][0]["agreement"]["plain composite"]["agrees"] is True


def test_cpu_clock_times_the_calling_thread(tmp_path):
    """--clock cpu: the calling thread's CPU time (robust on a shared machine), which only
    counts a call's whole work on one thread: refused without --threads 1."""
    threads = torch.get_num_threads()
    try:
        data = run_json(tmp_path, "--threads", "1", "--clock", "cpu", "--mode", "fwd")
        assert data["timer"].startswith("time.thread_time") and data["threads"] == 1
        rows = data["points"][0]["modes"]["fwd"]
        assert all(r["min_ms"] > 0 for r in rows)
        torch.set_num_threads(2)
        with pytest.raises(SystemExit, match="--threads 1"):
            bench.run([*TINY, "--threads", "2", "--clock", "cpu"])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("op", ["ppo_loss", "ppo_loss_from_hidden"])
def test_tensor_parallel_rows(tmp_path, op):
    """--tp 2: the fused op over a vocabulary split on 2 gloo ranks, timed beside the
    unsharded rows (its ratio to the ideal, the unsharded fused median / 2) and its
    collectives alone; refused where it cannot run."""
    from helpers.ranks import exclusive_cores
    threads = torch.get_num_threads()
    try:
        with exclusive_cores():
            data = run_json(tmp_path, "--op", op, "--tp", "2", "--threads", "1",
                            "--mode", "fwd+bwd", "--V", "65")
        assert data["tp"] == 2
        assert data["points"][0]["agreement"]["fused, tp 2"]["agrees"] is True
        rows = {r["variant"]: r for r in data["points"][0]["modes"]["fwd+bwd"]}
        tp = rows["fused, tp 2"]
        assert tp["kind"] == "fused" and tp["reps"] == 1 and tp["min_ms"] > 0
        assert tp["vs_ideal"] == pytest.approx(
            tp["median_ms"] / (rows["fused"]["median_ms"] / 2))
        assert rows["tp all-gather alone"]["kind"] == rows["tp validity header alone"]["kind"] \
            == "collective"
        assert ("tp all-reduce alone" in rows) == (op == "ppo_loss_from_hidden")
        with pytest.raises(SystemExit, match="--tp"):
            bench.run([*TINY, "--op", "gae", "--tp", "2"])
    finally:
        torch.set_num_threads(threads)


def test_extra_rows_with_the_benchmarks_tensor_options(tmp_path):
    """--extra's own tensor options: sampling_mask_k=K (a given kept set of K ids per
    position) and temperature_per_seq=LO:HI (a per-sequence temperature [B]) become the op's
    sampling_mask and temperature; those rows compute another loss (not compared)."""
    data = run_json(tmp_path, "--mode", "fwd+bwd",
                    "--extra", "given:sampling_mask_k=4",
                    "--extra", "given, t:sampling_mask_k=4,temperature_per_seq=0.7:1.3")
    rows = {r["variant"] for r in data["points"][0]["modes"]["fwd+bwd"]}
    assert {"fused", "given", "given, t"} <= rows
    assert not {"given", "given, t"} & set(data["points"][0]["agreement"])
    x = bench.make_inputs("ppo_loss", 2, 8, 64, 16, torch.float32, "cpu", 0.1, 4)
    o = bench.extra_tensors({"sampling_mask_k": 4, "temperature_per_seq": "0.5:1.5"}, x)
    assert set(o) == {"sampling_mask", "temperature"}
    assert o["sampling_mask"].offsets.tolist() == list(range(0, 2 * 8 * 4 + 1, 4))
    assert o["temperature"].tolist() == [0.5, 1.5]
    # each kept set holds the sampled token
    ids = o["sampling_mask"].token_ids.view(16, 4)
    assert (ids == x["tokens"].reshape(-1, 1)).any(1).all()
