"""One benchmark entry point for every op: the fused kernel against the baselines a user
would otherwise run, measured in the same process, interleaved, after an agreement check.

    python -m ppo_kernels.bench --op ppo_loss --B 4 --T 1024 --V 32000 \\
        --opt kl_coef=0.05 --opt kl_estimator=k3 --opt entropy_coef=0.01 --opt dual_clip_c=3
    ppo-kernels-bench --op ppo_loss --opt policy_loss=gspo --json gspo.json
    ppo-kernels-bench --op ppo_loss_from_hidden --B 4 --T 1024 --H 2048 --V 32000 --no-compile

Baselines (each where the op and its options allow it; a skipped one is listed with why):
  plain composite      what a user writes: log_softmax -> gather -> ratio -> clip -> masked
                       mean (with the KL / entropy terms when those options are on; for GSPO
                       the sequence ratio), in float32
  F.cross_entropy      the same with logp = -F.cross_entropy(..., reduction="none")
  cross-entropy loss   not a PPO loss: F.cross_entropy(logits, tokens) alone (mean over every
                       position), the least a loss op on the same logits costs in torch
                       (ppo_loss and token_logprobs; left out of the agreement check)
  torch.compile        torch.compile(plain composite, dynamic=False) (--no-compile skips it)
  eager composite      the library's own composite, backend="torch"
  materialised         from-hidden ops: logits = hidden @ W.T, then the fused logits op
  liger                Liger-Kernel's triton_grpo_loss (CUDA only, when it is installed and
                       the options are ones it computes)
  floor                not a loss: one read of the logits and one write of a tensor of their
                       size (torch.empty_like(x).copy_(x) into a buffer mapped beforehand);
                       for the from-hidden ops the head's matmuls; for gae a copy of [2, B, T]
docs/BENCHMARKING.md explains every column and how the times and the memory are measured.
Timings are not tests.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
import types

import torch
import torch.nn.functional as F

import ppo_kernels as pk
from ppo_kernels import bench_tp

# ------------------------------------------------------------------ measuring (shared with
# benchmarks/_measure.py, which re-exports these for the scripts in benchmarks/)

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


# the clocks of --clock: wall time, or the CPU time of the calling thread (user + system,
# page faults included), which other jobs on a shared machine do not inflate; it equals
# the wall time of a one-thread call on an idle machine, and needs --threads 1
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def wall_times_s(step, prepare=None, reps=5, warmup=2, clock=time.perf_counter):
    """Times in seconds (clock: wall time by default) of reps calls of step(prepare())
    (step() without prepare), after warmup untimed ones; prepare's work is not timed."""
    for _ in range(warmup):
        step(prepare()) if prepare else step()
    times = []
    for _ in range(reps):
        ready = prepare() if prepare else None
        t0 = clock()
        step(ready) if prepare else step()
        times.append(clock() - t0)
    return times


def median_s(step, prepare=None, reps=5, warmup=2):
    """Median wall time in seconds of step(prepare()) (step() without prepare) over reps
    calls, after warmup untimed ones; prepare's work is not timed."""
    return statistics.median(wall_times_s(step, prepare, reps, warmup))


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


def reexec_with(env_extra, argv=None):
    """Restarts this process with env_extra in its environment unless it is there already
    (glibc reads MALLOC_* only at start-up); argv: the new command line (default: the
    script and its arguments again)."""
    if all(os.environ.get(k) == v for k, v in env_extra.items()):
        return
    argv = [sys.executable, *sys.argv] if argv is None else argv
    os.execve(sys.executable, argv, dict(os.environ, **env_extra))


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
    """Times in seconds (clock: "wall", perf_counter, or "cpu", the calling thread's CPU
    time), peaks in bytes (VmHWM)."""

    name = "cpu"

    def __init__(self, clock="wall"):
        self.clock = CLOCKS[clock]

    def times_s(self, step, prepare=None, reps=5, warmup=1):
        return wall_times_s(step, prepare, reps, warmup, self.clock)

    def median_s(self, step, prepare=None, reps=5, warmup=1):
        return statistics.median(self.times_s(step, prepare, reps, warmup))

    def peak_extra_bytes(self, run):
        return peak_extra_bytes(run)


class CudaMeter:
    """Times in seconds from CUDA events (an L2 flush before every timed call, outside the
    timed region, so each call starts cold), peaks in bytes from max_memory_allocated."""

    name = "cuda"

    def __init__(self, flush_mib=256):
        self.flush = torch.empty(flush_mib * 2**20, dtype=torch.uint8, device="cuda")

    def times_s(self, step, prepare=None, reps=5, warmup=1):
        for _ in range(warmup):
            step(prepare()) if prepare else step()
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
        return times

    def median_s(self, step, prepare=None, reps=5, warmup=1):
        return statistics.median(self.times_s(step, prepare, reps, warmup))

    def peak_extra_bytes(self, run):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base


# ------------------------------------------------------------------ options

OPS = ["ppo_loss", "token_logprobs", "score_rollout", "ppo_loss_from_hidden",
       "token_logprobs_from_hidden", "distill_loss", "gae"]
MODES = {"fwd": ["fwd"], "fwd+bwd": ["fwd+bwd"], "both": ["fwd", "fwd+bwd"]}
NO_BACKWARD = {"score_rollout", "gae"}  # (their outputs carry no gradient)
FROM_HIDDEN = {"ppo_loss_from_hidden", "token_logprobs_from_hidden"}
LOSSES = {"ppo_loss", "ppo_loss_from_hidden", "distill_loss"}
# options that change how the result is computed, not its value (the plain composite
# ignores them); backward_scale is the benchmark's own: the loss is multiplied by it
# before backward (gradient accumulation's loss / k)
VALUE_NEUTRAL = {"grad_scale", "inplace_backward", "chunk_size", "logits_dtype", "backend",
                 "backward_scale", "accum_dtype"}
DTYPE_OPTIONS = ("logits_dtype", "accum_dtype")  # given by name: bfloat16, torch.float32
# bench-level defaults per op (the op's own defaults for everything else)
OP_DEFAULTS = {"score_rollout": {"kl_coef": 0.05}}


def parse_value(text):
    """An option's value from the command line: JSON (numbers, true/false, null, lists),
    a fraction a/b, else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    low = text.strip().lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    if "/" in text:
        a, _, b = text.partition("/")
        try:
            return float(a) / float(b)
        except ValueError:
            pass
    return text


def load_mapping(path):
    """A JSON or YAML file holding one mapping."""
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        try:
            data = json.loads(text)
        except ValueError:
            import yaml

            data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a mapping of option names to values")
    return data


def trl_options(path):
    """pk.ppo_loss keywords of a TRL GRPOConfig given as a JSON / YAML mapping of its fields
    (the others at GRPOConfig's defaults), through integrations/_trl_config.from_trl_config."""
    import types

    from .integrations._trl_config import from_trl_config

    fields = load_mapping(path)
    try:
        import trl

        defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else
                             f.default_factory() if f.default_factory is not dataclasses.MISSING
                             else None) for f in dataclasses.fields(trl.GRPOConfig)}
    except ImportError:
        defaults = {}
    return from_trl_config(types.SimpleNamespace(**dict(defaults, **fields)))


def verl_options(path):
    """pk.ppo_loss keywords of a verl actor config (or a whole trainer config) given as a
    JSON / YAML mapping, through integrations/_verl_config.from_verl_config."""
    from .integrations._verl_config import from_verl_config

    return from_verl_config(load_mapping(path))


def gather_options(a):
    """The op's keyword options: the op's bench defaults, --trl-config / --verl-config,
    --config, then each --opt (later ones win)."""
    opts = dict(OP_DEFAULTS.get(a.op, {}))
    if a.trl_config:
        opts.update(trl_options(a.trl_config))
    if a.verl_config:
        opts.update(verl_options(a.verl_config))
    if a.config:
        opts.update(load_mapping(a.config))
    for item in a.opt:
        key, eq, val = item.partition("=")
        if not eq:
            raise SystemExit(f"--opt {item!r}: expected name=value")
        opts[key.strip()] = parse_value(val)
    if "backend" in opts:
        raise SystemExit("choose the fused backend with --backend, not --opt backend=...")
    return dtype_options(opts)


def dtype_options(opts):
    """opts with the dtype options given by name (DTYPE_OPTIONS) as torch dtypes."""
    for k in DTYPE_OPTIONS:
        if isinstance(opts.get(k), str):
            opts[k] = getattr(torch, opts[k].replace("torch.", ""))
    return opts


def op_options(opts):
    """opts without the benchmark's own keys (what the op is called with)."""
    return {k: v for k, v in opts.items() if k != "backward_scale"}


def show_options(opts):
    return " ".join(f"{k}={getattr(v, '__name__', None) or str(v).replace('torch.', '')}"
                    for k, v in opts.items()) or "(the op's defaults)"


# ------------------------------------------------------------------ inputs

def make_inputs(op, b, t, v, h, dtype, device, mask_frac, teacher_k, seed=0):
    """Random inputs of op (CPU generator, then moved): logits [B, T, V] (x 2, so the softmax
    is not flat) or hidden [B, T, H] and W [V, H]; tokens; mask (mask_frac of the tokens
    masked, the first of each sequence always valid); old / ref / rollout log-probs near the
    current ones; per-sequence advantages broadcast over T; values, scores; a top-k
    teacher."""
    g = torch.Generator().manual_seed(seed)
    x = {}
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) >= mask_frac
    mask[:, 0] = True
    if op in FROM_HIDDEN:
        x["hidden"] = torch.randn(b, t, h, generator=g).to(dtype)
        x["w"] = (torch.randn(v, h, generator=g) * (2.0 / h ** 0.5)).to(dtype)
        with torch.no_grad():
            lp = torch.log_softmax(F.linear(x["hidden"], x["w"]).float(), -1)
    elif op != "gae":
        x["logits"] = (torch.randn(b, t, v, generator=g) * 2).to(dtype)
        with torch.no_grad():
            lp = torch.log_softmax(x["logits"].float(), -1)
    if op != "gae":
        lp = lp.gather(-1, tokens[..., None])[..., 0]
    else:
        lp = torch.zeros(b, t)
    x.update(tokens=tokens, mask=mask, old=lp + 0.1 * torch.randn(b, t, generator=g),
             ref=lp - 0.05 * torch.rand(b, t, generator=g),
             adv=torch.randn(b, 1, generator=g).expand(b, t).contiguous(),
             values=torch.randn(b, t, generator=g), scores=torch.randn(b, generator=g),
             rewards=torch.randn(b, t, generator=g))
    # the inference engine's log-probs, near the old ones (drawn last: the inputs above stay
    # those of earlier runs with the same seed)
    x["rollout"] = x["old"] + 0.05 * torch.randn(b, t, generator=g)
    if op == "distill_loss":
        n, k = b * t, min(teacher_k, v)
        stride = max(1, v // k)  # k distinct ids per position: (start + j * stride) mod V
        start = torch.randint(0, v, (n, 1), generator=g)
        ids = (start + torch.arange(k) * stride) % v
        tl = torch.log_softmax(torch.randn(n, k, generator=g) * 2, -1) + math.log(0.9)
        x["teacher"] = pk.SparseLogprobs(ids.reshape(-1), torch.arange(0, n * k + 1, k),
                                         tl.reshape(-1).contiguous())
    return {k: (pk.SparseLogprobs(*(y.to(device) for y in val)) if k == "teacher"
                else val.to(device)) for k, val in x.items()}


def sampling_mask_of(x, k, v, seed=1):
    """A given kept set of k ids per position (the sampled token among them), CSR."""
    g = torch.Generator().manual_seed(seed)
    tokens = x["tokens"].reshape(-1).cpu()
    n = tokens.numel()
    k = max(1, min(k, v))
    stride = max(1, v // k)
    ids = (tokens[:, None] + torch.arange(k) * stride) % v
    del g
    dev = x["tokens"].device
    return pk.SamplingMask(ids.reshape(-1).to(dev), torch.arange(0, n * k + 1, k).to(dev))


# ------------------------------------------------------------------ plain composites

def logp_log_softmax(z, tokens):
    return torch.log_softmax(z, -1).gather(-1, tokens[..., None])[..., 0]


def logp_cross_entropy(z, tokens):
    v = z.shape[-1]
    return -F.cross_entropy(z.reshape(-1, v), tokens.reshape(-1),
                            reduction="none").view(tokens.shape)


def plain_entropy(z):
    logp_all = torch.log_softmax(z, -1)
    return -(logp_all.exp() * logp_all).sum(-1)


def plain_agg(x, m, mode):
    """Masked aggregation of a [B, T] term by loss_agg_mode, as a user writes it."""
    if mode == "token-mean":
        return (x * m).sum() / m.sum().clamp(min=1)
    if mode == "token-sum":
        return (x * m).sum()
    if mode == "seq-mean-token-mean":
        lens = m.sum(-1)
        per = (x * m).sum(-1) / lens.clamp(min=1)
        return per.sum() / (lens > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return (x * m).sum(-1).mean()
    raise AssertionError(mode)


PLAIN_PPO = {"policy_loss": ("vanilla", "gspo"), "clip_eps_low": None, "clip_eps_high": None,
             "dual_clip_c": None, "kl_coef": None,
             "kl_estimator": ("k1", "k2", "k3", "abs"), "entropy_coef": None,
             "entropy_agg_mode": None, "temperature": None,
             "loss_agg_mode": ("token-mean", "token-sum", "seq-mean-token-mean",
                               "seq-mean-token-sum")}


def plain_unsupported(op, opts):
    """Why the plain composite cannot compute op with opts (None: it can)."""
    if op in ("ppo_loss", "ppo_loss_from_hidden"):
        allowed = PLAIN_PPO
    elif op in ("token_logprobs", "token_logprobs_from_hidden"):
        allowed = {"temperature": None, "return_entropy": None}
    elif op == "score_rollout":
        allowed = {"kl_coef": None, "kl_estimator": ("k1", "k2", "k3", "abs"),
                   "gamma": None, "lam": None, "whiten": None, "temperature": None}
    elif op == "gae":
        allowed = {"gamma": None, "lam": None}
    elif op == "distill_loss":
        allowed = {"tail": None, "temperature": None}
    else:
        return f"no plain composite for {op}"
    for k, val in opts.items():
        if k in VALUE_NEUTRAL:
            continue
        if k not in allowed:
            return f"option {k} is not in the plain composite (it covers " \
                   f"{', '.join(allowed)})"
        if allowed[k] is not None and val not in allowed[k]:
            return f"{k}={val} is not in the plain composite"
        if k == "temperature" and not isinstance(val, (int, float)):
            return "a tensor temperature is not in the plain composite"
    eam = opts.get("entropy_agg_mode")
    if eam is not None and eam != opts.get("loss_agg_mode", "token-mean"):
        return "entropy_agg_mode differs from loss_agg_mode"
    return None


def plain_ppo_loss(logits, tokens, mask, old, adv, ref, o, logp_of=logp_log_softmax):
    """The PPO / GRPO loss as a user writes it (Schulman et al. 2017, eq. 7; dual clip: Ye
    et al. 2020, eq. 5; GSPO's sequence ratio: Zheng et al. 2025; k1 / k2 / k3 KL: Schulman
    2020), on float32 logits."""
    z = logits.float()
    temp = o.get("temperature", 1.0)
    if temp != 1.0:
        z = z / temp
    logp = logp_of(z, tokens)
    m = mask.float()
    if o.get("policy_loss", "vanilla") == "gspo":
        seq = ((logp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        ratio = torch.exp(seq).expand_as(logp)
    else:
        ratio = torch.exp(logp - old)
    lo = o.get("clip_eps_low", 0.2)
    hi = o.get("clip_eps_high") if o.get("clip_eps_high") is not None else lo
    pg = torch.maximum(-ratio * adv, -torch.clamp(ratio, 1 - lo, 1 + hi) * adv)
    c = o.get("dual_clip_c")
    if c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -c * adv), pg)
    mode = o.get("loss_agg_mode", "token-mean")
    loss = plain_agg(pg, m, mode)
    kl_coef = o.get("kl_coef", 0.0)
    if kl_coef:
        loss = loss + kl_coef * plain_agg(plain_kl(logp, ref, o.get("kl_estimator", "k3")),
                                          m, mode)
    ent_coef = o.get("entropy_coef", 0.0)
    if ent_coef:
        loss = loss - ent_coef * plain_agg(plain_entropy(z), m, mode)
    return loss


def plain_kl(logp, ref, estimator):
    d = logp - ref
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "abs":
        return d.abs()
    return torch.exp(-d) - 1 + d  # k3


def plain_token_logprobs(logits, tokens, mask, o, logp_of=logp_log_softmax):
    z = logits.float()
    temp = o.get("temperature", 1.0)
    if temp != 1.0:
        z = z / temp
    logp = torch.where(mask, logp_of(z, tokens), 0.0)
    if o.get("return_entropy"):
        return logp, torch.where(mask, plain_entropy(z), 0.0)
    return (logp,)


def plain_gae(rewards, values, mask, gamma, lam):
    """GAE (Schulman et al. 2016, eq. 16) as a reverse loop over T; masked positions carry
    the next value and advantage across unchanged."""
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    last = rewards.new_zeros(b)
    next_v = rewards.new_zeros(b)
    for i in reversed(range(t)):
        m = mask[:, i]
        a = rewards[:, i] + gamma * next_v - values[:, i] + gamma * lam * last
        adv[:, i] = torch.where(m, a, 0.0)
        last = torch.where(m, a, last)
        next_v = torch.where(m, values[:, i], next_v)
    return adv, torch.where(mask, adv + values, 0.0)


def plain_score_rollout(logits, tokens, mask, ref, values, scores, o):
    z = logits.float()
    temp = o.get("temperature", 1.0)
    if temp != 1.0:
        z = z / temp
    logp = torch.where(mask, logp_log_softmax(z, tokens), 0.0)
    kl = torch.where(mask, plain_kl(logp, ref, o.get("kl_estimator", "k1")), 0.0)
    rewards = -o["kl_coef"] * kl
    t = mask.shape[1]
    last = (torch.arange(t, device=mask.device) * mask).argmax(-1)
    rewards = rewards.scatter_add(1, last[:, None], scores[:, None].float())
    adv, ret = plain_gae(rewards, values.float(), mask, o.get("gamma", 1.0),
                         o.get("lam", 0.95))
    if o.get("whiten", True):
        m = mask.float()
        n = m.sum()
        mean = (adv * m).sum() / n
        var = (((adv - mean) * m) ** 2).sum() / (n - 1).clamp(min=1)
        adv = torch.where(mask, (adv - mean) * torch.rsqrt(var + 1e-8), 0.0)
    return logp, kl, rewards, adv, ret


def plain_distill(logits, teacher, mask, o):
    """Top-k forward KL with the tail bucket (GKD, arXiv:2306.13649), k ids per position."""
    b, t, v = logits.shape
    n = b * t
    z = logits.float().reshape(n, v)
    temp = o.get("temperature", 1.0)
    if temp != 1.0:
        z = z / temp
    k = teacher.token_ids.numel() // n
    ids = teacher.token_ids.view(n, k)
    lt = teacher.logprobs.view(n, k).float()
    ls = torch.log_softmax(z, -1).gather(1, ids)
    pt = lt.exp()
    kl = (pt * (lt - ls)).sum(1)
    if o.get("tail", True):
        big_t, big_s = pt.sum(1), ls.exp().sum(1)
        kl = kl + (1 - big_t) * (torch.log1p(-big_t) - torch.log1p(-big_s))
    m = mask.reshape(n).float()
    return (kl * m).sum() / m.sum().clamp(min=1)


# ------------------------------------------------------------------ variants

@dataclasses.dataclass
class Variant:
    """One row: fn(x) -> tuple of tensors (x: the inputs, the leaves replaced in fwd+bwd).
    kind: "fused", "baseline" or "floor"; prepare(x) -> x, untimed, before each call."""

    name: str
    fn: object
    kind: str = "baseline"
    modes: tuple = ("fwd", "fwd+bwd")
    prepare: object = None
    scale: float = 1.0
    compare: bool = True  # in the agreement check (an extra row with other loss options: no)
    leaves: tuple = None  # (the op's leaves when None)
    grad_view: object = None  # maps this variant's gradients onto the fused one's shapes


def leaves_of(op):
    return {"ppo_loss": ("logits",), "token_logprobs": ("logits",),
            "distill_loss": ("logits",), "ppo_loss_from_hidden": ("hidden", "w"),
            "token_logprobs_from_hidden": ("hidden", "w")}.get(op, ())


def _tuple(out):
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(out)


def fused_fn(op, backend, opts, x_extra=None):
    """The op itself, backend=backend, with opts."""
    o = op_options(opts)
    inplace = bool(o.get("inplace_backward"))

    def rollout(x):
        # rollout_logprobs where the options read them (a rollout correction needs them)
        if o.get("rollout_correction") or o.get("off_policy_mask_threshold") is not None:
            return {"rollout_logprobs": x["rollout"]}
        return {}

    def ppo(x):
        lg = x["logits"]
        if inplace and lg.requires_grad:
            lg = lg.view_as(lg)  # (a non-leaf: the logits' storage receives the gradient)
        ref = x["ref"] if o.get("kl_coef", 0.0) else None
        return (pk.ppo_loss(lg, x["tokens"], x["old"], x["adv"], x["mask"], ref,
                            backend=backend, **rollout(x), **o)[0],)

    def ppo_h(x):
        ref = x["ref"] if o.get("kl_coef", 0.0) else None
        return (pk.ppo_loss_from_hidden(x["hidden"], x["w"], x["tokens"], x["old"], x["adv"],
                                        x["mask"], ref, backend=backend, **rollout(x),
                                        **o)[0],)

    fns = {
        "ppo_loss": ppo,
        "ppo_loss_from_hidden": ppo_h,
        "token_logprobs": lambda x: _tuple(pk.token_logprobs(
            x["logits"], x["tokens"], x["mask"], backend=backend, **o)),
        "token_logprobs_from_hidden": lambda x: _tuple(pk.token_logprobs_from_hidden(
            x["hidden"], x["w"], x["tokens"], x["mask"], backend=backend, **o)),
        "score_rollout": lambda x: tuple(pk.score_rollout(
            x["logits"], x["tokens"], x["ref"], x["values"], x["scores"], x["mask"],
            backend=backend, **o)),
        "distill_loss": lambda x: (pk.distill_loss(x["logits"], x["teacher"], x["mask"],
                                                   backend=backend, **o)[0],),
        "gae": lambda x: tuple(pk.gae(x["rewards"], x["values"], x["mask"], backend=backend,
                                      **o)),
    }
    return fns[op]


def cross_entropy_loss(x):
    """The cross-entropy loss row: F.cross_entropy of the logits (positions t < T of
    [B, T + 1, V] ones) against the tokens, the mean over every position, as an SFT step
    computes it; the least a loss on the same logits costs in torch."""
    z, tokens = x["logits"], x["tokens"]
    z = z[:, :tokens.shape[1]] if z.dim() == 3 else z
    return (F.cross_entropy(z.reshape(-1, z.shape[-1]), tokens.reshape(-1)),)


def plain_fn(op, opts, logp_of=logp_log_softmax):
    o = op_options(opts)
    if op == "ppo_loss":
        return lambda x: (plain_ppo_loss(x["logits"], x["tokens"], x["mask"], x["old"],
                                         x["adv"], x["ref"], o, logp_of),)
    if op == "ppo_loss_from_hidden":
        return lambda x: (plain_ppo_loss(F.linear(x["hidden"], x["w"]), x["tokens"],
                                         x["mask"], x["old"], x["adv"], x["ref"], o, logp_of),)
    if op == "token_logprobs":
        return lambda x: plain_token_logprobs(x["logits"], x["tokens"], x["mask"], o, logp_of)
    if op == "token_logprobs_from_hidden":
        return lambda x: plain_token_logprobs(F.linear(x["hidden"], x["w"]), x["tokens"],
                                              x["mask"], o, logp_of)
    if op == "score_rollout":
        return lambda x: plain_score_rollout(x["logits"], x["tokens"], x["mask"], x["ref"],
                                             x["values"], x["scores"], o)
    if op == "gae":
        return lambda x: plain_gae(x["rewards"], x["values"], x["mask"], o.get("gamma", 1.0),
                                   o.get("lam", 0.95))
    if op == "distill_loss":
        return lambda x: (plain_distill(x["logits"], x["teacher"], x["mask"], o),)
    raise AssertionError(op)


def compiled_fn(op, opts):
    """torch.compile of the plain composite on the op's tensor arguments (dynamic=False);
    the compilation happens in the first (warm-up) call."""
    plain = plain_fn(op, opts)
    keys = {"ppo_loss": ("logits", "tokens", "mask", "old", "adv", "ref"),
            "ppo_loss_from_hidden": ("hidden", "w", "tokens", "mask", "old", "adv", "ref"),
            "token_logprobs": ("logits", "tokens", "mask"),
            "token_logprobs_from_hidden": ("hidden", "w", "tokens", "mask"),
            "score_rollout": ("logits", "tokens", "mask", "ref", "values", "scores"),
            "gae": ("rewards", "values", "mask"),
            "distill_loss": ("logits", "teacher", "mask")}.get(op)
    if keys is None:
        return None

    def by_position(*args):
        return plain(dict(zip(keys, args)))
    comp = torch.compile(by_position, dynamic=False)
    return lambda x: comp(*(x[k] for k in keys))


def liger_fn(op, opts, device):
    """Liger-Kernel's triton_grpo_loss (logits [B, T + 1, V], per-sequence advantages, k3
    KL only, no entropy / dual clip), token-mean reduced; None with the reason when it does
    not apply."""
    if device != "cuda":
        return None, "Liger-Kernel runs on CUDA only"
    if op != "ppo_loss":
        return None, f"no Liger-Kernel op wired for {op}"
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        return None, "liger_kernel is not installed"
    o = op_options(opts)
    ok = {"clip_eps_low", "clip_eps_high", "kl_coef", "kl_estimator", "temperature",
          "loss_agg_mode"} | VALUE_NEUTRAL
    bad = [k for k in o if k not in ok]
    if bad or o.get("kl_estimator", "k3") != "k3" or \
            o.get("loss_agg_mode", "token-mean") != "token-mean":
        return None, f"options Liger's grpo_loss does not compute: {bad or 'kl / agg mode'}"
    lo = o.get("clip_eps_low", 0.2)
    hi = o.get("clip_eps_high") if o.get("clip_eps_high") is not None else lo
    beta = float(o.get("kl_coef", 0.0))

    def run(x):
        per_tok = triton_grpo_loss(x["logits_ext"], x["old"], x["ref"] if beta else None,
                                   x["tokens"], x["adv"][:, 0].contiguous(), x["mask"].int(),
                                   float(o.get("temperature", 1.0)), beta, lo, hi,
                                   inplace=False)[0]
        m = x["mask"].float()
        return ((per_tok * m).sum() / m.sum(),)
    return run, None


def floor_fn(op):
    """Not the op: the least memory traffic (logits ops), the head's matmuls (from-hidden
    ops: 1 forward, 3 with the backward's), a copy of [2, B, T] (gae)."""
    floor = CopyFloor()

    def run(x, mode):
        if op in FROM_HIDDEN:
            h2 = x["hidden"].reshape(-1, x["hidden"].shape[-1])
            z = h2 @ x["w"].t()
            if mode == "fwd+bwd":
                return z @ x["w"], z.t() @ h2
            return z
        if op == "gae":
            return floor(x["both"])
        return floor(x["logits"])
    run.floor = floor
    return run


def extra_tensors(o, x):
    """o with the benchmark's own tensor options of an --extra row made into the op's:
    sampling_mask_k=K (a given kept set of K ids per position, sampling_mask_of) and
    temperature_per_seq=LO:HI (a per-sequence temperature tensor [B], LO to HI)."""
    o = dict(o)
    k = o.pop("sampling_mask_k", None)
    v = x["logits"].shape[-1] if "logits" in x else x["w"].shape[0] if "w" in x else None
    if k is not None and v is not None:
        o["sampling_mask"] = sampling_mask_of(x, int(k), v)
    span = o.pop("temperature_per_seq", None)
    if span is not None:
        lo, hi = (float(p) for p in str(span).split(":"))
        b = x["tokens"].shape[0]
        o["temperature"] = torch.linspace(lo, hi, b, device=x["tokens"].device)
    return o


def build_variants(op, a, opts, device, x):
    """[Variant], {name: why skipped}."""
    backend = a.backend
    vs, skipped = [], {}
    modes = ("fwd",) if op in NO_BACKWARD else ("fwd", "fwd+bwd")
    scale = float(opts.get("backward_scale", 1.0))

    def inplace_prepare(o):
        if not o.get("inplace_backward") or "logits" not in x:
            return None
        src, scratch = x["logits"], x["logits"].clone()
        return lambda xx: dict(xx, logits=scratch.copy_(src))

    vs.append(Variant("fused", fused_fn(op, backend, opts), "fused", modes,
                      inplace_prepare(opts), scale))
    for spec in a.extra:
        name, _, rest = spec.partition(":")
        o2 = dict(opts)
        for item in filter(None, rest.split(",")):
            k, _, val = item.partition("=")
            o2[k.strip()] = parse_value(val)
        o2 = extra_tensors(dtype_options(o2), x)
        same = all(o2.get(k) == opts.get(k) for k in set(o2) | set(opts)
                   if k not in VALUE_NEUTRAL)
        vs.append(Variant(name.strip(), fused_fn(op, backend, o2), "fused", modes,
                          inplace_prepare(o2), float(o2.get("backward_scale", 1.0)),
                          compare=same))
    why = plain_unsupported(op, op_options(opts))
    if why is None:
        vs.append(Variant("plain composite", plain_fn(op, opts), modes=modes))
        if op in ("ppo_loss", "ppo_loss_from_hidden", "token_logprobs",
                  "token_logprobs_from_hidden"):
            vs.append(Variant("F.cross_entropy", plain_fn(op, opts, logp_cross_entropy),
                              modes=modes))
        else:
            skipped["F.cross_entropy"] = f"no cross-entropy form of {op}"
        if a.no_compile:
            skipped["torch.compile"] = "--no-compile"
        elif op == "gae" and x["rewards"].shape[1] > a.gae_compile_max_t:
            skipped["torch.compile"] = f"gae: dynamo unrolls the loop over T > " \
                                       f"{a.gae_compile_max_t} (--gae-compile-max-t)"
        else:
            fn = compiled_fn(op, opts)
            if fn is None:
                skipped["torch.compile"] = f"no compiled composite for {op}"
            else:
                vs.append(Variant("torch.compile", fn, modes=modes))
    else:
        for name in ("plain composite", "F.cross_entropy", "torch.compile"):
            skipped[name] = why
    if op in ("ppo_loss", "token_logprobs"):
        vs.append(Variant("cross-entropy loss", cross_entropy_loss, modes=modes,
                          compare=False))
    else:
        skipped["cross-entropy loss"] = f"{op} takes no logits"
    vs.append(Variant("eager composite", fused_fn(op, "torch", opts), modes=modes))
    if op in FROM_HIDDEN:
        lop = op.replace("_from_hidden", "")
        o = {k: v for k, v in op_options(opts).items()
             if k not in ("chunk_size", "lm_head_bias", "logit_softcap") + DTYPE_OPTIONS}
        inner = fused_fn(lop, backend, o)
        vs.append(Variant("materialised", lambda xx: inner(
            dict(xx, logits=F.linear(xx["hidden"], xx["w"]))), modes=modes))
    fn, why = liger_fn(op, opts, device)
    if fn is None:
        skipped["liger"] = why
    else:
        vs.append(Variant("liger", fn, modes=modes, leaves=("logits_ext",),
                          grad_view=lambda g: g[:, :-1]))
    vs.append(Variant("floor", floor_fn(op), "floor", modes))
    drop = {n.strip() for item in a.skip for n in item.split(",")} - {"fused"}
    for v in vs:
        if v.name in drop:
            skipped[v.name] = "--skip"
    return [v for v in vs if v.name not in drop], skipped


def step(v, x, mode, op):
    """One call of variant v: (outputs, gradients of the leaves) (gradients () in fwd)."""
    if v.kind == "floor":
        return v.fn(x, mode), ()
    if mode == "fwd":
        with torch.no_grad():
            return v.fn(x), ()
    xs = dict(x)
    leaves = []
    for k in v.leaves or leaves_of(op):
        xs[k] = x[k].detach().requires_grad_(True)
        leaves.append(xs[k])
    out = v.fn(xs)
    s = out[0] if len(out) == 1 and out[0].dim() == 0 else sum(o.float().sum() for o in out)
    (s * v.scale if v.scale != 1.0 else s).backward()
    return out, tuple(t.grad for t in leaves)


# ------------------------------------------------------------------ agreement

def max_diff(got, want):
    """(max |got - want|, that over max |want|) over paired tensors."""
    abs_d, ref = 0.0, 0.0
    for a_, b_ in zip(got, want):
        if a_ is None or b_ is None:
            continue
        a_, b_ = a_.detach().double(), b_.detach().double()
        abs_d = max(abs_d, float((a_ - b_).abs().max()))
        ref = max(ref, float(b_.abs().max()))
    return abs_d, abs_d / max(ref, 1e-30)


def tolerance(dtype):
    """The relative difference under which a row agrees with the fused one."""
    return {torch.float64: 1e-9, torch.float32: 2e-4}.get(dtype, 5e-2)


def agreement_row(dv, dg, tol):
    """One row of the agreement check from max_diff's (abs, rel) of the values and of the
    gradients (dg None: no gradient compared)."""
    ok = dv[1] <= tol and (dg is None or dg[1] <= tol)
    return {"value_max_abs_diff": dv[0], "value_max_rel_diff": dv[1],
            "grad_max_abs_diff": dg[0] if dg else None,
            "grad_max_rel_diff": dg[1] if dg else None, "tolerance": tol,
            "agrees": bool(ok)}


def agreement(vs, x, op, dtype):
    """Compares each variant's outputs (and, with a backward, its gradients) with the fused
    one's, in fwd+bwd where the op has a backward, else fwd. Returns {name: dict}."""
    mode = "fwd" if op in NO_BACKWARD else "fwd+bwd"
    tol = tolerance(dtype)
    out = {}
    ref = None
    for v in vs:
        if v.kind == "floor" or mode not in v.modes or not v.compare:
            continue
        xv = v.prepare(x) if v.prepare else x
        vals, grads = step(v, xv, mode, op)
        if v.scale != 1.0:
            grads = tuple(g / v.scale for g in grads)
        if v.grad_view is not None:
            grads = tuple(v.grad_view(g) for g in grads)
        if ref is None:
            ref = (vals, grads)
            continue
        out[v.name] = agreement_row(max_diff(vals, ref[0]),
                                    max_diff(grads, ref[1]) if grads else None, tol)
    return out


# ------------------------------------------------------------------ timing

def measure(vs, x, mode, op, meter, reps, warmup, memory):
    """{name: row}: the variants' times interleaved (one call of each per round, the order
    rotated every round), then each one's peak extra memory."""
    live = [v for v in vs if mode in v.modes]
    calls = {}
    for v in live:
        if v.kind == "floor":
            v.fn.floor.clear()
            v.fn(x, mode)  # the floor's output buffer is mapped before the timing
        calls[v.name] = (lambda ready, v=v: step(v, ready, mode, op),
                         (lambda v=v: v.prepare(x)) if v.prepare else (lambda: x))
        for _ in range(warmup):
            calls[v.name][0](calls[v.name][1]())
    times = {v.name: [] for v in live}
    for r in range(reps):
        order = live[r % len(live):] + live[:r % len(live)]
        for v in order:
            fn, prep = calls[v.name]
            times[v.name] += meter.times_s(fn, prep, reps=1, warmup=0)
    rows = {}
    for v in live:
        t = times[v.name]
        peak = None
        if memory:
            gc.collect()
            pk.empty_cache()
            fn, prep = calls[v.name]
            ready = prep()
            peak = meter.peak_extra_bytes(lambda: fn(ready))
        rows[v.name] = time_row(v.name, v.kind, t, peak)
    return rows


def time_row(name, kind, times, peak=None):
    """A table row from the timed calls' seconds (and the peak extra bytes, or None)."""
    return {"variant": name, "kind": kind, "min_ms": min(times) * 1e3,
            "median_ms": statistics.median(times) * 1e3, "max_ms": max(times) * 1e3,
            "reps": len(times), "peak_extra_bytes": peak}


# ------------------------------------------------------------------ output

def fmt_ratio(x):
    return f"{x:.2f}x" if x is not None else "-"


def print_table(point, mode, rows, nv_bytes):
    fused = rows.get("fused")
    w = max([22] + [len(name) + 2 for name in rows])
    print(f"\n{point['label']}  mode {mode}")
    head = (f"{'variant':<{w}}{'min ms':>10}{'median ms':>11}{'max ms':>10}{'reps':>6}"
            f"{'peak MiB':>10}{'[N,V] f32':>10}{'/ fused':>9}")
    print(head)
    print("-" * len(head))
    for r in rows.values():
        peak = r["peak_extra_bytes"]
        pm = f"{peak / 2**20:>10.1f}" if peak is not None else f"{'n/a':>10}"
        pn = f"{peak / nv_bytes:>10.3f}" if peak is not None else f"{'n/a':>10}"
        rel = r["median_ms"] / fused["median_ms"] if fused else None
        print(f"{r['variant']:<{w}}{r['min_ms']:>10.3f}{r['median_ms']:>11.3f}"
              f"{r['max_ms']:>10.3f}{r['reps']:>6}{pm}{pn}{fmt_ratio(rel):>9}")
    if fused:
        sp = ", ".join(f"{name} {fmt_ratio(r['median_ms'] / fused['median_ms'])}"
                       for name, r in rows.items() if r["kind"] == "baseline")
        print(f"fused speed-up (baseline median / fused median): {sp or '-'}")
        fl = rows.get("floor")
        if fl:
            print(f"fused median / floor median: {fmt_ratio(fused['median_ms'] / fl['median_ms'])}")
        for r in rows.values():
            if "vs_ideal" in r:
                print(f"{r['variant']} median / ideal (the unsharded fused median / ranks): "
                      f"{fmt_ratio(r['vs_ideal'])}")


def write_csv(path, result):
    cols = ["op", "B", "T", "V", "H", "N", "dtype", "device", "mode", "variant", "kind",
            "min_ms", "median_ms", "max_ms", "reps", "peak_extra_bytes", "vs_fused",
            "options"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for p in result["points"]:
            for mode, rows in p["modes"].items():
                for r in rows:
                    w.writerow({"op": result["op"], "B": p["B"], "T": p["T"], "V": p["V"],
                                "H": p["H"], "N": p["N"], "dtype": result["dtype"],
                                "device": result["device"], "mode": mode,
                                "options": result["options_text"],
                                **{k: r.get(k) for k in cols if k in r},
                                "vs_fused": r["vs"].get("fused")})


def write_plot(path, result):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed; no plot written")
        return
    pts = result["points"]
    axis = next((k for k in ("V", "T", "B", "H") if len({p[k] for p in pts}) > 1), "V")
    modes = list(pts[0]["modes"])
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        names = [r["variant"] for r in pts[0]["modes"][mode]]
        for name in names:
            xs, ys = [], []
            for p in pts:
                r = next((r for r in p["modes"][mode] if r["variant"] == name), None)
                if r is not None:
                    xs.append(p[axis])
                    ys.append(r["median_ms"])
            ax.plot(xs, ys, marker="o", label=name)
        ax.set_xlabel(axis)
        ax.set_ylabel("median ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{result['op']} {mode} ({result['dtype']}, {result['device']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


# ------------------------------------------------------------------ main

def int_list(text):
    return [int(s) for s in str(text).split(",") if s.strip()]


def build_parser():
    ap = argparse.ArgumentParser(
        prog="ppo-kernels-bench",
        description="Benchmarks one op of ppo_kernels (the fused kernel) against the plain "
                    "PyTorch composite, its F.cross_entropy form, torch.compile of it, the "
                    "library's eager composite, Liger-Kernel (CUDA, where installed) and the "
                    "copy floor, all in the same run. See docs/BENCHMARKING.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--op", default="ppo_loss", choices=OPS,
                    help="The op to benchmark. Sampling replay is ppo_loss or token_logprobs "
                         "with --opt top_k=..., --opt top_p=... or --sampling-mask-k.")
    ap.add_argument("--B", default="4", type=int_list,
                    help="Sequences per batch; a comma list sweeps over the values.")
    ap.add_argument("--T", default="1024", type=int_list,
                    help="Tokens per sequence; a comma list sweeps over the values.")
    ap.add_argument("--V", default="32000", type=int_list,
                    help="Vocabulary size; a comma list sweeps over the values.")
    ap.add_argument("--H", default="2048", type=int_list,
                    help="Hidden size of the from-hidden ops; a comma list sweeps over it.")
    ap.add_argument("--dtype", default="float32",
                    choices=["float32", "bfloat16", "float16", "float64"],
                    help="The dtype of the logits (or of the hidden states and the head).")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="Where the inputs live and the ops run.")
    ap.add_argument("--backend", default="auto",
                    choices=["auto", "cpu", "cuda", "triton", "torch"],
                    help="The backend of the fused rows (the eager composite always runs "
                         "backend='torch').")
    ap.add_argument("--opt", action="append", default=[], metavar="NAME=VALUE",
                    help="A keyword option of the op under its own name, e.g. "
                         "kl_coef=0.05, kl_estimator=k3, dual_clip_c=3, policy_loss=gspo; "
                         "repeat it for several. Values are read as JSON, then a/b "
                         "fractions, then strings.")
    ap.add_argument("--config", help="A JSON or YAML file with a mapping of the op's keyword "
                                     "options; --opt entries override it.")
    ap.add_argument("--trl-config", help="A JSON or YAML file with TRL GRPOConfig fields; "
                                         "the loss options are converted by "
                                         "ppo_kernels.integrations (from_trl_config).")
    ap.add_argument("--verl-config", help="A JSON or YAML file with verl's actor config "
                                          "(or the whole trainer config); converted by "
                                          "ppo_kernels.integrations (from_verl_config).")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME:K=V,K=V",
                    help="An additional fused row with some options changed, e.g. "
                         "'inplace:inplace_backward=true'. The benchmark's own options: "
                         "backward_scale=S multiplies the loss by S before backward; "
                         "sampling_mask_k=K passes a given kept set of K ids per position; "
                         "temperature_per_seq=LO:HI a per-sequence temperature tensor.")
    ap.add_argument("--skip", action="append", default=[], metavar="NAME[,NAME]",
                    help="Rows not to run, by their names in the table (e.g. 'floor', "
                         "'F.cross_entropy'); the fused row always runs.")
    ap.add_argument("--mode", default="both", choices=list(MODES),
                    help="fwd times the op under torch.no_grad(); fwd+bwd times the forward "
                         "and loss.backward() with the gradient into the logits (or the "
                         "hidden states and the head); both does each.")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads for the CPU (default: torch's own choice).")
    ap.add_argument("--clock", default="wall", choices=list(CLOCKS),
                    help="CPU timings: wall time, or cpu, the CPU time of the calling thread "
                         "(user + system), which other jobs on a shared machine do not "
                         "inflate; cpu needs --threads 1 (every op then runs in that thread).")
    ap.add_argument("--tp", type=int, default=1,
                    help="Also time the fused op with its vocabulary split over this many "
                         "gloo ranks on the CPU (ppo_loss, ppo_loss_from_hidden), each with "
                         "--threads threads, and its collectives alone; 'vs ideal' is the "
                         "median over the unsharded fused median / tp.")
    ap.add_argument("--reps", type=int, default=10, help="Timed calls of each variant.")
    ap.add_argument("--warmup", type=int, default=2,
                    help="Untimed calls of each variant first (torch.compile compiles here).")
    ap.add_argument("--mask-frac", type=float, default=0.1,
                    help="The fraction of tokens that are masked (response_mask 0).")
    ap.add_argument("--sampling-mask-k", type=int, default=None,
                    help="Sampling replay with a given kept set of this many ids per token "
                         "(passes sampling_mask=...).")
    ap.add_argument("--teacher-k", type=int, default=64,
                    help="The teacher's ids per position of distill_loss.")
    ap.add_argument("--no-compile", action="store_true",
                    help="Skip the torch.compile row (its compilation is slow on the CPU).")
    ap.add_argument("--gae-compile-max-t", type=int, default=256,
                    help="The largest T at which gae's loop is compiled.")
    ap.add_argument("--no-memory", action="store_true",
                    help="Skip the peak memory measurement (printed as n/a).")
    ap.add_argument("--seed", type=int, default=0, help="The seed of the random inputs.")
    ap.add_argument("--json", help="Also write the results to this JSON file.")
    ap.add_argument("--csv", help="Also write one CSV row per measurement to this file.")
    ap.add_argument("--plot", help="Also plot median times over the swept size to this PNG "
                                   "(needs matplotlib).")
    ap.add_argument("--quiet", action="store_true", help="Print no tables.")
    return ap


def run(argv=None):
    """Parses argv, runs the benchmark, prints the tables and returns the result dict (what
    --json writes)."""
    a = build_parser().parse_args(argv)
    # The objects alive before the run (torch's modules, a test process's imports) are
    # frozen out of the cycle collector while it runs: the gc.collect() before each peak
    # memory measurement then scans only what the run made (0.18 s a collect otherwise,
    # most of a small shape's run). https://docs.python.org/3/library/gc.html#gc.freeze
    gc.freeze()
    try:
        return _run(a)
    finally:
        gc.unfreeze()


def _run(a):
    if a.threads:
        torch.set_num_threads(a.threads)
    op = a.op
    opts = gather_options(a)
    modes = [m for m in MODES[a.mode] if not (m == "fwd+bwd" and op in NO_BACKWARD)]
    if not modes:
        raise SystemExit(f"{op} has no backward: use --mode fwd")
    dtype = getattr(torch, a.dtype)
    device = a.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if a.clock == "cpu" and (device == "cuda" or torch.get_num_threads() != 1):
        raise SystemExit("--clock cpu times the calling thread: it needs --device cpu and "
                         "--threads 1 (other threads' work would not be counted)")
    bench_tp.check(a, op, device)
    meter = CudaMeter() if device == "cuda" else CpuMeter(a.clock)
    memory = not a.no_memory and (device == "cuda" or os.path.exists("/proc/self/clear_refs"))
    mem_method = ("torch.cuda.max_memory_allocated minus memory_allocated" if device == "cuda"
                  else "VmHWM minus VmRSS (glibc mmap threshold "
                       + ("set" if os.environ.get("MALLOC_MMAP_THRESHOLD_") else
                          "NOT set: freed buffers may be reused unseen") + ")")
    info = pk.build_info()
    result = {"op": op, "options": {k: str(v) if isinstance(v, torch.dtype) else v
                                    for k, v in opts.items()},
              "options_text": show_options(opts), "dtype": a.dtype, "device": device,
              "backend": a.backend, "modes": modes, "reps": a.reps, "warmup": a.warmup,
              "mask_frac": a.mask_frac, "threads": torch.get_num_threads(), "tp": a.tp,
              "torch": torch.__version__, "cpu_capability": info.get("cpu_capability"),
              "memory": mem_method if memory else "n/a", "timer":
                  "CUDA events, 256 MiB L2 flush before each call" if device == "cuda"
                  else {"wall": "time.perf_counter (wall)",
                        "cpu": "time.thread_time (the calling thread's CPU time)"}[a.clock],
              "points": []}
    if not a.quiet:
        print(f"{op}: {a.dtype} on {device}, fused backend {a.backend}, "
              f"{torch.get_num_threads()} threads, SIMD {info.get('cpu_capability')}, "
              f"torch {torch.__version__}")
        print(f"options: {result['options_text']}")
        print(f"mask fraction {a.mask_frac}; {a.reps} timed calls per variant after "
              f"{a.warmup} warm-up ones, interleaved; times: {result['timer']}; "
              f"peak extra memory: {result['memory']}")
    sizes = [(b, t, v, h) for b in a.B for t in a.T for v in a.V
             for h in (a.H if op in FROM_HIDDEN else a.H[:1])]
    for b, t, v, h in sizes:
        x = make_inputs(op, b, t, v, h, dtype, device, a.mask_frac, a.teacher_k, a.seed)
        popts = dict(opts)
        if a.sampling_mask_k:
            popts["sampling_mask"] = sampling_mask_of(x, a.sampling_mask_k, v)
        if op == "gae":
            x["both"] = torch.stack([x["rewards"], x["values"]])
        vs, skipped = build_variants(op, a, popts, device, x)
        if any(vv.name == "liger" for vv in vs):
            x["logits_ext"] = torch.cat([x["logits"], x["logits"][:, -1:]], 1)
        n = b * t
        label = f"B={b} T={t} V={v}" + (f" H={h}" if op in FROM_HIDDEN else "") + f" (N={n})"
        point = {"B": b, "T": t, "V": v, "H": h if op in FROM_HIDDEN else None, "N": n,
                 "label": label, "skipped": skipped}
        point["agreement"] = agreement(vs, x, op, dtype)
        tp = {}
        if a.tp > 1:
            tp = bench_tp.tp_rows(a.tp, dict(
                op=op, size=(b, t, v, h), dtype=dtype, backend=a.backend, opts=popts,
                modes=modes, reps=a.reps, warmup=a.warmup, threads=torch.get_num_threads(),
                clock=a.clock, mask_frac=a.mask_frac, seed=a.seed, bench=_TP_BENCH))
            # the split op's outputs (their sums, rank 0's) against the fused one's
            fused_out, _ = step(vs[0], vs[0].prepare(x) if vs[0].prepare else x, modes[0], op)
            point["agreement"][f"fused, tp {a.tp}"] = agreement_row(max_diff(
                [torch.tensor(tp["value"])],
                [torch.tensor([float(o.detach().double().sum()) for o in fused_out])]),
                None, tolerance(dtype))
        if not a.quiet:
            print(f"\n{label}: agreement with the fused output"
                  + ("" if op in NO_BACKWARD else " and gradient")
                  + " (max |diff|, relative to max |fused|):")
            for name, d in point["agreement"].items():
                g = "" if d["grad_max_abs_diff"] is None else \
                    f", grad {d['grad_max_abs_diff']:.2e} ({d['grad_max_rel_diff']:.1e})"
                flag = "ok" if d["agrees"] else f"DISAGREES (tolerance {d['tolerance']:.0e})"
                print(f"  {name:<20} value {d['value_max_abs_diff']:.2e} "
                      f"({d['value_max_rel_diff']:.1e}){g}  {flag}")
            for name, why in skipped.items():
                print(f"  {name:<20} skipped: {why}")
            for vv in vs:
                if not vv.compare:
                    print(f"  {vv.name:<20} not compared: other loss options than fused's")
        point["modes"] = {}
        for mode in modes:
            rows = measure(vs, x, mode, op, meter, a.reps, a.warmup, memory)
            fused_ms = rows["fused"]["median_ms"]
            for r in tp.get(mode, ()):
                rows[r["variant"]] = r
                if r["kind"] == "fused":
                    r["vs_ideal"] = r["median_ms"] / (fused_ms / a.tp)
            for r in rows.values():
                r["vs"] = {name: r["median_ms"] / o["median_ms"] for name, o in rows.items()
                           if name != r["variant"]}
                r["vs"]["fused"] = r["median_ms"] / fused_ms
            point["modes"][mode] = list(rows.values())
            if not a.quiet:
                print_table(point, mode, rows, n * v * 4)
        result["points"].append(point)
        del x, vs
        gc.collect()
    result["all_agree"] = all(d["agrees"] for p in result["points"]
                              for d in p["agreement"].values())
    if not result["all_agree"] and not a.quiet:
        print("\nWARNING: some variants disagree with the fused op (above): their times "
              "are not of the same computation")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    if a.csv:
        write_csv(a.csv, result)
    if a.plot:
        write_plot(a.plot, result)
    return result


# what the --tp ranks call (pickled by reference: bench_tp does not import this module)
_TP_BENCH = types.SimpleNamespace(make_inputs=make_inputs, fused_fn=fused_fn, Variant=Variant,
                                  step=step, CpuMeter=CpuMeter, time_row=time_row)


def main(argv=None):
    """The console entry point (ppo-kernels-bench, python -m ppo_kernels.bench). Run from
    the command line on Linux's CPU it restarts itself once with glibc's mmap threshold set
    (MMAP_ENV) so that the peak memory counts every large buffer."""
    if argv is None and sys.platform.startswith("linux"):
        a = build_parser().parse_args()
        if a.device == "cpu" and not a.no_memory:
            reexec_with(MMAP_ENV, [sys.executable, "-m", "ppo_kernels.bench", *sys.argv[1:]])
    run(argv)


if __name__ == "__main__":
    main()
