"""CPU benchmark: one GRPO loss step of TRL 1.16's stock `trl.GRPOTrainer` against
`ppo_kernels.integrations.trl.FusedGRPOTrainer` (docs/TRL.md), the claim behind "a TRL user
swaps the trainer class and gets the same training run with less memory".

    python benchmarks/trl_bench.py               # V 32000, 128000 x (B x T) 8x256, 8x512
    python benchmarks/trl_bench.py --quick       # a smoke test: dapo, tiny (~15 s)
    python benchmarks/trl_bench.py --sizes 32000x8x512 --cases dapo --reps 5

The step: `loss = trainer._compute_loss(model, inputs); loss.backward()`, the method
GRPOTrainer.compute_loss calls, on a batch as TRL's _generate_and_score_completions hands
it over (left-padded prompts of --prompt tokens, right-padded completions of T tokens with
lengths between T / 2 and T, per-sequence advantages, old log-probs 0.1 off the current
ones, for `grpo-kl` reference log-probs too). The model: a randomly initialised Llama
(hidden --hidden, 2 layers, float32) so that the LM head dominates, built and saved here
(no downloads); both trainers load it from the same folder and read the same batch file.

Cases: `dapo` (loss_type="dapo", beta 0) at every size; `grpo-kl` (loss_type="grpo",
beta 0.04, k3 KL with TRL's bias correction) at --kl-size (default: the last size).

Stock TRL runs its fused LM head (trl.kernels.ChunkedLogProbFunction, chunks of 4096 tokens
and 32768 vocabulary entries); on the CPU it scores every position, the prompt's and the
padding's too (its Triton path, on a GPU, scores the valid ones only: not measured here).
The fused trainer takes the backbone's last hidden state of the completion positions and
runs pk.ppo_loss_from_hidden (chunks of rows, no [N, V] logits stored).

Time: the median wall time of the step over --reps calls after --warmup (both trainers in
this process). Peak memory: as benchmarks/from_hidden_bench.py measures it
(benchmarks/_measure.py), in one fresh subprocess per variant and point, with glibc's mmap
threshold fixed, after all the timing (--jobs of them at once: each reads its own VmHWM,
so only the wall time changes; 1 by default, 2 with --quick): one warm-up step, the
gradients set to None and pk.empty_cache(), then Linux's VmHWM reset through
/proc/self/clear_refs and the step's peak RSS above the RSS before it. The peak includes
the parameter gradients the step leaves (dW [V, H] among them), the same for both.
Losses: both trainers' on the same batch, with their relative difference and the largest
relative gradient difference over the parameters (each tensor against its largest entry);
the script fails if the loss differs by more than --loss-rtol. Timings are not tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure  # noqa: E402  (the timing loop and the peak probe)

CASES = {"dapo": dict(loss_type="dapo"),
         "grpo-kl": dict(loss_type="grpo", beta=0.04)}
VARIANTS = ("stock", "fused")
FULL = dict(sizes=["32000x8x256", "32000x8x512", "128000x8x256", "128000x8x512"],
            cases=list(CASES), hidden=256, prompt=16, reps=3, jobs=1)
QUICK = dict(sizes=["2048x4x32"], cases=["dapo"], hidden=64, prompt=8, reps=1, jobs=2)
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 "
SEED = 0


def parse_size(s):
    """'VxBxT' -> (V, B, T)."""
    try:
        v, b, t = (int(x) for x in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {s!r}: expected VxBxT, e.g. 32000x8x256")
    return v, b, t


def size_name(size):
    v, b, t = size
    return f"V={v} {b}x{t}"


# ------------------------------------------------------------------ model, tokenizer, trainer

def tokenizer():
    """A character-level tokenizer (the trainer wants one; the batch is made of ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", padding_side="left")


def save_model(path, v, hidden, max_len):
    """A random float32 Llama (2 layers, untied head) saved under path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=v, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_len, pad_token_id=0, eos_token_id=1,
                      bos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).float().save_pretrained(path)


def reward_len(completions, **kwargs):
    return [len(c) / 8.0 for c in completions]


def make_trainer(variant, case, model_path, out_dir, t):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ppo_kernels.integrations.trl import FusedGRPOTrainer

    args = GRPOConfig(output_dir=out_dir, report_to="none", per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=t, use_cpu=True, bf16=False,
                      seed=SEED, save_strategy="no", logging_steps=1,
                      gradient_accumulation_steps=1, **CASES[case])
    cls = FusedGRPOTrainer if variant == "fused" else GRPOTrainer
    data = Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "go"]})
    tr = cls(model=model_path, reward_funcs=reward_len, args=args, train_dataset=data,
             processing_class=tokenizer())
    tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    return tr


def make_batch(stock, b, p, t, v):
    """The micro-batch _compute_loss gets (see the module docstring); the old and reference
    log-probs are the current ones (TRL's own scoring, no grad) plus noise."""
    g = torch.Generator().manual_seed(SEED + 1)
    prompt_ids = torch.randint(3, v, (b, p), generator=g)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    for i in range(1, b, 2):  # left padding on every other prompt
        prompt_mask[i, :int(torch.randint(1, p // 2 + 1, (1,), generator=g))] = 0
    prompt_ids[prompt_mask == 0] = 0
    comp_ids = torch.randint(3, v, (b, t), generator=g)
    lens = torch.randint(t // 2, t + 1, (b,), generator=g)
    lens[0] = t
    comp_mask = (torch.arange(t)[None] < lens[:, None]).long()
    comp_ids[comp_mask == 0] = 0
    with torch.no_grad():
        lp, _, _ = stock._get_per_token_logps_and_entropies(
            stock.model, torch.cat([prompt_ids, comp_ids], 1),
            torch.cat([prompt_mask, comp_mask], 1), t)
    valid = comp_mask.bool()
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": comp_ids,
            "completion_mask": comp_mask,
            "advantages": torch.randn(b, generator=g),
            "num_items_in_batch": comp_mask.sum(),
            "old_per_token_logps": torch.where(valid, lp + 0.1 * torch.randn(b, t, generator=g),
                                               0.0),
            "ref_per_token_logps": torch.where(valid, lp + 0.1 * torch.randn(b, t, generator=g),
                                               0.0)}


def step(tr, inputs):
    """One loss step: _compute_loss forward + backward (the gradients accumulate into
    whatever .grad holds: the callers set them to None first)."""
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    loss = tr._compute_loss(tr.model, inputs)
    loss.backward()
    return loss.detach()


def fresh_step(tr, inputs):
    tr.model.zero_grad(set_to_none=True)
    return step(tr, inputs)


# ------------------------------------------------------------------ peak memory (child)

def measure_peak_here(a):
    import ppo_kernels as pk

    tr = make_trainer(a.peak_of, a.case, a.model_dir, a.out_dir, a.t)
    inputs = torch.load(a.batch)
    fresh_step(tr, inputs)  # first-call work at this shape, outside the window
    tr.model.zero_grad(set_to_none=True)
    gc.collect()
    pk.empty_cache()  # the CPU kernels' recycled gradient buffer: counted in the window
    print(_measure.peak_extra_bytes(lambda: step(tr, inputs)))


def peak_child(variant, case, model_dir, batch, out_dir, t):
    return _measure.child_peak([os.path.abspath(__file__), "--peak-of", variant, "--case", case,
                                "--model-dir", model_dir, "--batch", batch,
                                "--out-dir", out_dir, "--t", t], _measure.MMAP_ENV)


# ------------------------------------------------------------------ main

def compare(trainers, inputs):
    """(stock loss, fused loss, relative loss difference, max relative gradient difference)."""
    losses, grads = {}, {}
    for name, tr in trainers.items():
        losses[name] = float(fresh_step(tr, inputs))
        grads[name] = {n: p.grad.detach().double().clone()
                       for n, p in tr.model.named_parameters() if p.grad is not None}
        tr.model.zero_grad(set_to_none=True)
    ls, lf = losses["stock"], losses["fused"]
    rel = abs(lf - ls) / max(abs(ls), 1e-30)
    gs, gf = grads["stock"], grads["fused"]
    if sorted(gs) != sorted(gf):
        raise SystemExit(f"the trainers' gradients cover different parameters: "
                         f"{sorted(set(gs) ^ set(gf))}")
    grel = max(float((gf[n] - gs[n]).abs().max() / gs[n].abs().max().clamp(min=1e-30))
               for n in gs)
    return ls, lf, rel, grel


def time_point(case, size, a, work, model_dirs):
    """Losses and times of both trainers at one point; the batch saved for the peak children
    (the result's "peak_jobs")."""
    v, b, t = size
    model_dir = model_dirs[v]
    out_dir = os.path.join(work, "out")
    trainers = {name: make_trainer(name, case, model_dir, out_dir, t) for name in VARIANTS}
    batch_file = os.path.join(work, f"batch_{case}_{v}_{b}x{t}.pt")
    inputs = make_batch(trainers["stock"], b, a.prompt, t, v)
    torch.save(inputs, batch_file)
    ls, lf, rel, grel = compare(trainers, inputs)
    rows = {}
    for name in VARIANTS:
        sec = _measure.median_s(lambda tr=trainers[name]: fresh_step(tr, inputs), None,
                                a.reps, a.warmup)
        rows[name] = {"seconds": sec}
        trainers[name].model.zero_grad(set_to_none=True)
    rows["stock"]["loss"], rows["fused"]["loss"] = ls, lf
    return {"case": case, "V": v, "B": b, "T": t, "prompt": a.prompt, "hidden": a.hidden,
            "tokens": int(inputs["completion_mask"].sum()), "loss_rel_diff": rel,
            "grad_rel_diff": grel, "rows": rows,
            "peak_jobs": {name: (name, case, model_dir, batch_file, out_dir, t)
                          for name in VARIANTS}}


def measure_peaks(results, jobs):
    """Fills each row's peak_extra_bytes from its child (jobs children at a time: each
    measures its own process's peak, so running them side by side changes only the wall
    time; --quick does, the full run does not)."""
    todo = [(r, name, args) for r in results for name, args in r.pop("peak_jobs").items()]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        peaks = list(pool.map(lambda job: peak_child(*job[2]), todo))
    for (r, name, _), peak in zip(todo, peaks):
        r["rows"][name]["peak_extra_bytes"] = peak


def print_point(r):
    s, f = r["rows"]["stock"], r["rows"]["fused"]
    print(f"\n{r['case']}  V={r['V']} B={r['B']} T={r['T']} (prompt {r['prompt']}, "
          f"{r['tokens']} valid completion tokens)")
    print(f"loss stock {s['loss']:.9g} fused {f['loss']:.9g} rel diff {r['loss_rel_diff']:.2e}"
          f"  (max rel grad diff {r['grad_rel_diff']:.2e})")


def table(results):
    head = (f"{'case':<9}{'size':<18}{'variant':<8}{'time [ms]':>11}{'peak extra [MiB]':>18}"
            f"{'time f/s':>10}{'peak f/s':>10}{'loss rel diff':>15}")
    lines = [head, "-" * len(head)]
    for r in results:
        s, f = r["rows"]["stock"], r["rows"]["fused"]
        for name in VARIANTS:
            x = r["rows"][name]
            tr = f"{f['seconds'] / s['seconds']:.2f}" if name == "fused" else ""
            pr = (f"{f['peak_extra_bytes'] / max(s['peak_extra_bytes'], 1):.3f}"
                  if name == "fused" else "")
            ld = f"{r['loss_rel_diff']:.1e}" if name == "fused" else ""
            lines.append(f"{r['case']:<9}{size_name((r['V'], r['B'], r['T'])):<18}{name:<8}"
                         f"{x['seconds'] * 1e3:>11.1f}{x['peak_extra_bytes'] / 2**20:>18.1f}"
                         f"{tr:>10}{pr:>10}{ld:>15}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                    help="VxBxT points (default 32000x8x256 32000x8x512 128000x8x256 "
                         "128000x8x512)")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=None,
                    help="default: both (--quick: dapo)")
    ap.add_argument("--kl-size", type=parse_size, default=None,
                    help="the size grpo-kl runs at (default: the last of --sizes)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 256)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 16)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--loss-rtol", type=float, default=1e-5,
                    help="fail if the losses differ by more (relative)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: dapo, V=2048 4x32, hidden 64, prompt 8, 1 rep")
    ap.add_argument("--jobs", type=int, default=None,
                    help="peak-memory children run at once, after all the timing (default 1; "
                         "--quick: 2)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--peak-of", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--batch", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    ap.add_argument("--t", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peak_of:
        return measure_peak_here(a)
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, [parse_size(s) for s in v] if k == "sizes" else v)
    kl_size = a.kl_size or a.sizes[-1]
    points = [(c, s) for c in a.cases for s in (a.sizes if c != "grpo-kl" else [kl_size])]
    import trl

    import ppo_kernels as pk

    print(f"TRL {trl.__version__} GRPOTrainer vs ppo_kernels FusedGRPOTrainer: one "
          f"_compute_loss + backward on the CPU, float32, hidden {a.hidden}, 2 layers, prompt "
          f"{a.prompt}, {torch.get_num_threads()} threads, SIMD "
          f"{pk.build_info()['cpu_capability']}, median of {a.reps}")
    results = []
    with tempfile.TemporaryDirectory(prefix="trl_bench_") as work:
        max_len = a.prompt + max(s[2] for _, s in points)
        model_dirs = {}
        for v in sorted({s[0] for _, s in points}):
            model_dirs[v] = os.path.join(work, f"model_{v}")
            save_model(model_dirs[v], v, a.hidden, max_len)
        for case, size in points:
            r = time_point(case, size, a, work, model_dirs)
            print_point(r)
            results.append(r)
            gc.collect()
        measure_peaks(results, a.jobs)
    print("\n" + table(results))
    print("(time f/s, peak f/s: fused over stock; peak: the step's resident memory above the "
          "RSS before it, the parameter gradients included)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"hidden": a.hidden, "prompt": a.prompt, "reps": a.reps,
                       "threads": torch.get_num_threads(), "trl": trl.__version__,
                       "results": results}, f, indent=1)
    bad = [(r["case"], size_name((r["V"], r["B"], r["T"]))) for r in results
           if not r["loss_rel_diff"] <= a.loss_rtol]
    if bad:
        raise SystemExit(f"losses differ beyond rtol {a.loss_rtol}: {bad}")


if __name__ == "__main__":
    main()
