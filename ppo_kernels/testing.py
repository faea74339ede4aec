"""Test your own configuration of ppo_kernels against its float64 reference, in your CI.

    from ppo_kernels import testing
    testing.assert_matches_reference(dict(policy_loss="gspo", kl_coef=0.05), backend="cpu")
    testing.gradcheck(dict(policy_loss="gspo"), backend="cpu")

What is here (docs/TESTING_YOUR_CONFIG.md has the user file to copy):

- ``reference_ppo_loss``: the numpy float64 oracle (ppo_kernels/reference.py, analytic
  gradients) behind pk.ppo_loss's own signature: (loss, metrics, grad).
- ``TOLERANCES`` / ``tolerance``: what the library promises against that reference, per
  logits dtype and backend (docs/DESIGN.md "Precision", csrc/cuda/NOTES.md).
- ``make_batch`` (and ``make_mask``, ``one_token_rows``): inputs that LLM training meets:
  confident tokens, tied logits, tiny and huge log-ratios, empty sequences, packed rows.
- ``batches`` / ``loss_options``: hypothesis strategies (hypothesis is imported only when
  they are called; the package does not require it).
- ``assert_matches_reference``: runs pk.ppo_loss and compares loss, metrics and gradient.
- ``STOP_GRADIENTS`` / ``stop_gradients`` / ``gradcheck``: which parts of the loss are
  stop-gradient by design under which options, and a gradient check that knows it.
- ``opcheck_arguments`` / ``opcheck``: a raw kernel op's arguments built from public
  options, for ``torch.library.opcheck``.

Only the logits are differentiable inputs of ppo_loss: old_logprobs, advantages,
ref_logprobs, rollout_logprobs, rollout_is_weights, the masks and counts are data and
receive no gradient.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from . import reference as _ref
from .spec import KERNEL_POLICY_LOSSES, POLICY_LOSSES, SEQUENCE_POLICY_LOSSES

__all__ = ["Tolerance", "TOLERANCES", "tolerance", "reference_ppo_loss", "make_mask",
           "one_token_rows", "make_batch", "BATCH_KINDS", "batches", "loss_options",
           "assert_matches_reference", "STOP_GRADIENTS", "stop_gradients", "gradcheck",
           "registered_ops", "DIFFERENTIABLE_OPS", "opcheck_arguments", "opcheck"]


# ------------------------------------------------------------------ tolerances

class Tolerance(NamedTuple):
    """What a backend promises against the float64 reference, on the same (rounded) logits.

    loss: |loss - ref| <= loss * max(1, |ref|) (relative, floored at 1).
    metrics: |m - ref| <= metrics * max(1, |ref|) for every metric the reference has.
    grad: max |dlogits - ref| <= grad * max |ref| (relative to the largest entry).
    """

    loss: float
    metrics: float
    grad: float


# One table: (backend, logits dtype) -> Tolerance. Loss and metrics are accumulated in
# float32 (float64 for float64 logits) whatever the logits' dtype, so bf16 / fp16 only
# loosen the gradient, which comes back in the logits' dtype (8 / 11 mantissa bits). The
# metrics come back as float32 whatever the logits' dtype: for float64 logits their
# tolerance is that rounding (2**-24 relative, 6e-8), not float64's.
# cpu: ATen's exp_u20 (~1.2e-6 relative per entry); cuda: exp2f, 2 ulp, device tolerance
# of csrc/cuda/NOTES.md (logp 2e-6, H 2e-5, dlogits 2.5e-6; 5e-6 on confident rows);
# triton: tl.exp of the vocabulary sweeps (9e-7 at |x| = 20, DESIGN.md "Precision");
# torch: the eager composite (log_softmax), as cpu on these inputs (it does not keep the
# confident-token digits: make_batch(kind="confident") is checked with the kernels only).
_F32 = {"cpu": Tolerance(2e-6, 2e-5, 3e-6), "torch": Tolerance(2e-6, 2e-5, 3e-6),
        "triton": Tolerance(1e-5, 2e-5, 5e-6), "cuda": Tolerance(1e-5, 2e-5, 5e-6)}
TOLERANCES = {}
for _be, _t in _F32.items():
    TOLERANCES[(_be, torch.float32)] = _t
    TOLERANCES[(_be, torch.bfloat16)] = Tolerance(max(_t.loss, 1e-5), _t.metrics, 1e-2)
    TOLERANCES[(_be, torch.float16)] = Tolerance(max(_t.loss, 1e-5), _t.metrics, 1e-2)
    TOLERANCES[(_be, torch.float64)] = Tolerance(1e-10, 1e-7, 1e-10)


def tolerance(dtype=torch.float32, backend="cpu"):
    """The Tolerance of TOLERANCES for logits of ``dtype`` on ``backend`` ("auto" is the
    compiled kernel of the device: give the backend you run). ValueError for others."""
    key = (backend, dtype)
    if key not in TOLERANCES:
        raise ValueError(f"backend / dtype: no promised tolerance for backend={backend!r}, "
                         f"dtype={dtype} (known: {sorted({b for b, _ in TOLERANCES})} x "
                         f"float32, bfloat16, float16, float64)")
    return TOLERANCES[key]


# ------------------------------------------------------------------ the reference

class ReferenceResult(NamedTuple):
    """reference_ppo_loss's result: loss (0-d float64 tensor, or [B, T] for "none"), metrics
    (dict of 0-d float64 tensors), grad (float64, shaped like the logits: d loss / d logits,
    of loss.sum() for "none")."""

    loss: torch.Tensor
    metrics: dict
    grad: torch.Tensor


# options of pk.ppo_loss that change nothing the reference computes (grad_scale is a hint:
# the loss and gradient are the same for any value; backend and memory options)
_NO_MATH = ("backend", "grad_scale", "inplace_backward", "max_seqlen")
_DISTRIBUTED = ("tp_group", "vocab_start", "cp_group")
_REPLAY = ("sampling_mask", "top_k", "top_p", "min_p")


def _np(x):
    return None if x is None else _ref.as_f64(x)


def _unpack(cu_seqlens, total):
    cu = [int(c) for c in _ref._as_int(cu_seqlens)]
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens: expected 0 = c_0 <= ... <= c_S = {total}, got {cu}")
    return cu


def reference_ppo_loss(logits, tokens, old_logprobs, advantages, response_mask=None,
                       ref_logprobs=None, **options):
    """pk.ppo_loss's float64 reference, with pk.ppo_loss's own signature and keywords.

    Args: those of pk.ppo_loss (logits [B, T, V], [B, T + 1, V] or [N, V]; tokens [B, T] or
        [N]; the per-token inputs [B, T], advantages / rollout_is_weights also per sequence;
        cu_seqlens packed rows; sampling_mask / top_k / top_p / min_p kept sets). backend,
        grad_scale, inplace_backward and max_seqlen are accepted and change nothing here
        (grad_scale is a hint: the loss and its gradient are the same for any value).

    Returns:
        ReferenceResult(loss, metrics, grad): float64 CPU tensors; grad is d loss / d logits
        shaped like ``logits`` (of loss.sum() for loss_agg_mode="none"). metrics has the
        keys of pk.ppo_loss's that the reference computes (per_token_* with
        return_per_token=True).

    Raises:
        TypeError for an option pk.ppo_loss does not have; ValueError for tp_group /
        cp_group / vocab_start (the reference is one process: compare on the whole
        vocabulary and sequences) and for malformed cu_seqlens.

    The math: ppo_kernels/reference.py (DESIGN.md "Per-token math"; PPO clip, Schulman et
    al. 2017, eq. 7; dual clip, Ye et al. 2020, eq. 5; KL estimators, Schulman 2020;
    the policy-loss menu: docs/LOSSES.md).
    """
    from .spec import DEFAULTS
    known = set(DEFAULTS) | set(_NO_MATH) | set(_DISTRIBUTED) | set(_REPLAY) | {"cu_seqlens"}
    known |= {"rollout_is_weights", "rollout_logprobs", "global_num_tokens",
              "global_num_seqs"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"{unknown[0]}: not an option of ppo_loss")
    for k in _DISTRIBUTED:
        if options.get(k) is not None:
            raise ValueError(f"{k}: the reference runs on one process; pass the whole "
                             f"vocabulary / sequences")
    opts = {k: v for k, v in options.items()
            if k not in _NO_MATH + _DISTRIBUTED + _REPLAY + ("cu_seqlens", "return_per_token",
                                                              "cp_group")}
    per_token = bool(options.get("return_per_token", False))
    logits_shape = tuple(logits.shape)
    x = _ref.as_f64(logits)
    tok = _ref._as_int(tokens)
    cu = options.get("cu_seqlens")
    per_tok = dict(old_logprobs=old_logprobs, response_mask=response_mask,
                   ref_logprobs=ref_logprobs, rollout_logprobs=opts.get("rollout_logprobs"))
    per_seq = dict(advantages=advantages, rollout_is_weights=opts.get("rollout_is_weights"))
    temperature = opts.get("temperature", 1.0)
    if cu is not None:  # packed rows -> [S, L] (L the longest), as ppo_loss pads them
        x2 = x.reshape(-1, x.shape[-1])
        total = x2.shape[0]
        c = _unpack(cu, total)
        s_, L = len(c) - 1, max([b - a for a, b in zip(c, c[1:])] + [1])

        def pad(v, fill=0.0, dtype=np.float64):
            if v is None:
                return None
            v = np.asarray(v).reshape(-1, *np.asarray(v).shape[2:]) if np.ndim(v) > 1 and \
                np.asarray(v).shape[0] == 1 else np.asarray(v)
            out = np.full((s_, L) + v.shape[1:], fill, dtype=dtype)
            for i in range(s_):
                out[i, :c[i + 1] - c[i]] = v[c[i]:c[i + 1]]
            return out

        def seq_or_tok(v):
            if v is None:
                return None
            a = _ref.as_f64(v)
            if a.shape in ((s_, 1),) or (a.shape == (s_,) and s_ != total):
                return a.reshape(s_)
            return pad(a.reshape(-1))

        x = pad(x2)
        m = np.ones(total, bool) if response_mask is None else _ref.as_f64(
            response_mask).reshape(-1) != 0
        valid = pad(m.astype(np.float64)) > 0
        tok = pad(tok.reshape(-1), 0, np.int64)
        per_tok = {k: None if v is None else pad(_ref.as_f64(v).reshape(-1))
                   for k, v in per_tok.items()}
        per_tok["response_mask"] = valid
        per_seq = {k: seq_or_tok(v) for k, v in per_seq.items()}
        if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
            temperature = seq_or_tok(temperature)
            if temperature.ndim == 2:
                temperature = np.where(valid, temperature, 1.0)
    elif x.ndim == 2:  # [N, V]
        x, tok = x[None], tok[None]
        per_tok = {k: None if v is None else _ref.as_f64(v)[None] for k, v in per_tok.items()}
        per_seq = {k: None if v is None else _ref.as_f64(v).reshape(1, -1)
                   for k, v in per_seq.items()}
    else:
        per_tok = {k: _np(v) for k, v in per_tok.items()}
        per_seq = {k: _np(v) for k, v in per_seq.items()}
    if isinstance(temperature, torch.Tensor):
        temperature = _ref.as_f64(temperature)
        if temperature.ndim == 0:
            temperature = float(temperature)
        elif cu is None and len(logits_shape) == 2:
            temperature = temperature.reshape(1, -1)
    opts["temperature"] = temperature
    mask = per_tok["response_mask"]
    m = _ref._mask(mask, tok.shape) > 0
    kept = None
    if options.get("sampling_mask") is not None or any(
            options.get(k) is not None for k in ("top_k", "top_p", "min_p")):
        if cu is not None:
            raise ValueError("cu_seqlens: a kept set with packed rows is not supported by the "
                             "reference; compare the padded batch")
        sm = options.get("sampling_mask")
        shape = (tok.shape[0], tok.shape[1], x.shape[-1])
        if sm is not None:
            kept = _ref.kept_from_csr(sm.token_ids, sm.offsets, shape)
        else:
            kept = _ref.sampling_kept(x, tok, m, temperature, top_k=options.get("top_k"),
                                      top_p=options.get("top_p"), min_p=options.get("min_p"))
        kept, opts["kept_missing"] = _ref.with_token(kept, tok, m)
        opts["kept"] = kept
    opts.update(rollout_logprobs=per_tok.pop("rollout_logprobs"),
                rollout_is_weights=per_seq["rollout_is_weights"])
    safe_tok = np.where(m, tok, 0)  # garbage ids on masked positions are never read
    loss, metrics, grad = _ref.ppo_loss(x, safe_tok, per_tok["old_logprobs"],
                                        per_seq["advantages"], m, per_tok["ref_logprobs"],
                                        **opts)
    if per_token:
        lp, ent = _ref.token_logprobs(x, safe_tok, m, temperature)
        if kept is not None:
            lp_k, ent_k = _ref.kept_logprobs(x, safe_tok, m, temperature, kept)
            metrics["per_token_logprobs_full"] = lp
            lp = lp_k
            ent = ent_k if opts.get("entropy_over") == "kept" else ent
        metrics["per_token_logprobs"], metrics["per_token_entropy"] = lp, ent
    if cu is not None:  # back to the packed layout
        def unpad(v):
            v = np.asarray(v)
            return np.concatenate([v[i, :c[i + 1] - c[i]] for i in range(len(c) - 1)]
                                  or [v.reshape(0, *v.shape[2:])])
        grad = unpad(grad[:, :L]).reshape(logits_shape)
        if np.ndim(loss) == 2:
            loss = unpad(loss).reshape(tuple(tokens.shape))
        for k in ("per_token_logprobs", "per_token_entropy", "per_token_logprobs_full"):
            if k in metrics:
                metrics[k] = unpad(metrics[k]).reshape(tuple(tokens.shape))
    elif len(logits_shape) == 2:
        grad = grad[0]
        if np.ndim(loss) == 2:
            loss = np.asarray(loss)[0]
        for k in ("per_token_logprobs", "per_token_entropy", "per_token_logprobs_full"):
            if k in metrics:
                metrics[k] = np.asarray(metrics[k])[0]
    t = lambda v: torch.as_tensor(np.asarray(v, dtype=np.float64))  # noqa: E731
    return ReferenceResult(t(loss), {k: t(v) for k, v in metrics.items()},
                           t(grad).reshape(logits_shape))


# ------------------------------------------------------------------ inputs

def make_mask(B, T, gen, padding="mixed"):
    """bool [B, T]. padding: "mixed" (rows cycle through left, right and interior padding,
    at least one valid token each, so every pattern appears whenever B >= 3), "left",
    "right", "interior", "random", "none", "empty_row" (row B // 2 empty), "all" (every
    position masked). gen: a torch.Generator."""
    m = torch.ones(B, T, dtype=torch.bool)
    if T == 1 and padding not in ("all", "empty_row"):
        return m
    for b in range(B):
        kind = padding if padding != "mixed" else ("left", "right", "interior")[b % 3]
        k = 1 + int(torch.randint(0, max(T - 1, 1), (1,), generator=gen))  # pad length
        k = min(k, T - 1)
        if kind == "left":
            m[b, :k] = False
        elif kind == "right":
            m[b, T - k:] = False
        elif kind == "interior":
            if T >= 3:
                lo = 1 + int(torch.randint(0, T - 2, (1,), generator=gen))
                hi = min(T - 1, lo + max(1, k // 2))
                m[b, lo:hi] = False
        elif kind == "random":
            m[b] = torch.rand(T, generator=gen) > 0.3
        elif kind in ("none", "empty_row", "all"):
            pass
        else:
            raise ValueError(f"padding: unknown {kind!r}")
    if padding == "empty_row":
        m[B // 2] = False
    if padding == "all":
        m[:] = False
    return m


def one_token_rows(logp_values):
    """(logits [1, T, 2], tokens [1, T]) as numpy arrays, token 0 having the given
    log-probabilities (e.g. -1e-12: a confident token)."""
    lp = np.asarray(logp_values, dtype=np.float64)
    # log p0 = -log(1 + e^(x1 - x0)) with x0 = 0: x1 = log(e^(-lp) - 1)
    x = np.zeros((1, len(lp), 2))
    x[0, :, 1] = np.log(np.expm1(-lp))
    return x, np.zeros((1, len(lp)), dtype=np.int64)


BATCH_KINDS = ("random", "confident", "ties", "tiny_ratio", "huge_ratio", "empty", "packed")


def make_batch(B=2, T=5, V=11, *, kind="random", seed=0, dtype=torch.float32,
               device="cpu"):
    """pk.ppo_loss's inputs by argument name (logits, tokens, old_logprobs, advantages,
    response_mask, ref_logprobs, rollout_logprobs; cu_seqlens for "packed"), drawn as LLM
    training meets them. kind:

      random      logits randn * 2, padded rows (make_mask "mixed"), old / ref / rollout
                  log-probs near the current ones (ratios on both sides of the clip band);
      confident   the sampled token confident, 1 - p ~ 1e-10 .. 1e-3 (+12 .. +25 on its logit);
      ties        every row's logits take 3 values, the sampled token tied with others;
      tiny_ratio  |logp - old| ~ 1e-6 .. 1e-4 (the small-KL regime of k3 / approx_kl);
      huge_ratio  log-ratios of +-25 on some tokens (past the clamp at 20);
      empty       one sequence with no valid token (make_mask "empty_row");
      packed      B sequences of lengths T, 0, ... packed into [total, V] with cu_seqlens.

    Masked positions hold garbage token ids (never read). dtype: the logits' (per-token
    inputs are float32, float64 for float64 logits). Returns a dict of tensors on device."""
    if kind not in BATCH_KINDS:
        raise ValueError(f"kind: expected one of {BATCH_KINDS}, got {kind!r}")
    for name, v in (("B", B), ("T", T), ("V", V)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2.0
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = make_mask(B, T, g, "empty_row" if kind == "empty" else
                     ("none" if kind == "packed" else "mixed"))
    if kind == "confident":
        boost = 12.0 + 13.0 * torch.rand(B, T, 1, generator=g, dtype=torch.float64)
        x.scatter_add_(2, tokens[..., None], boost)
    elif kind == "ties":
        levels = torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float64)
        x = levels[torch.randint(0, 3, (B, T, V), generator=g)]
        x.scatter_(2, tokens[..., None], 2.0)
    x = x.to(dtype)
    logp, _ = _ref.token_logprobs(x.double(), tokens, None)
    logp = torch.from_numpy(logp)
    if kind == "tiny_ratio":
        mag = torch.exp(torch.empty(B, T, dtype=torch.float64).uniform_(
            math.log(1e-6), math.log(1e-4), generator=g))
        sign = torch.where(torch.rand(B, T, generator=g) < 0.5, -1.0, 1.0).double()
        old = logp - sign * mag
    else:
        old = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    if kind == "huge_ratio":
        flip = torch.rand(B, T, generator=g) < 0.3
        old = torch.where(flip, logp + torch.where(torch.rand(B, T, generator=g) < 0.5,
                                                   25.0, -25.0).double(), old)
    refl = logp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    garbage = torch.tensor([-1, V, V + 1000])
    tokens = torch.where(mask, tokens, garbage[torch.randint(0, 3, (B, T), generator=g)])
    out = dict(logits=x, tokens=tokens, old_logprobs=old.to(acc), advantages=adv.to(acc),
               response_mask=mask, ref_logprobs=refl.to(acc), rollout_logprobs=rollout.to(acc))
    if kind == "packed":  # lengths T, 0, T - 1, T, 0, ...: an empty sequence among them
        lens = [(T, 0, max(T - 1, 1))[b % 3] for b in range(B)]
        rows = [(b, t) for b in range(B) for t in range(lens[b])]
        idx_b = torch.tensor([r[0] for r in rows], dtype=torch.long)
        idx_t = torch.tensor([r[1] for r in rows], dtype=torch.long)
        out = {k: (v[idx_b, idx_t] if k != "response_mask" else v[idx_b, idx_t])
               for k, v in out.items()}
        out["cu_seqlens"] = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32)
    return {k: v.to(device) for k, v in out.items()}


# ------------------------------------------------------------------ hypothesis strategies

def _st():
    try:
        from hypothesis import strategies
    except ImportError as e:  # (a test dependency, not the package's)
        raise ImportError("ppo_kernels.testing's strategies need hypothesis: pip install "
                          "hypothesis") from e
    return strategies


def batches(*, max_B=3, max_T=6, max_V=13, kinds=BATCH_KINDS, dtype=torch.float32):
    """A hypothesis strategy of make_batch dicts: B, T, V up to the maxima, a kind of
    ``kinds`` and a seed."""
    st = _st()
    return st.builds(lambda b, t, v, k, s: make_batch(b, t, v, kind=k, seed=s, dtype=dtype),
                     st.integers(1, max_B), st.integers(1, max_T), st.integers(1, max_V),
                     st.sampled_from(tuple(kinds)), st.integers(0, 2**31 - 1))


def loss_options(*, policy_losses=POLICY_LOSSES, with_rollout=True):
    """A hypothesis strategy of valid ppo_loss option dicts (the keywords LossSpec.build
    accepts: policy loss, clip band, dual clip where the loss has one, KL estimator and
    coefficient, entropy, temperature, aggregation, rollout correction)."""
    st = _st()

    @st.composite
    def opts(draw):
        pl = draw(st.sampled_from(tuple(policy_losses)))
        o = dict(policy_loss=pl)
        if pl == "cispo":
            o.update(clip_eps_low=draw(st.floats(0.0, 1.0)),
                     clip_eps_high=draw(st.floats(0.0, 4.0)))
        elif pl in ("dppo-tv", "dppo-kl"):
            o.update(clip_eps_low=draw(st.floats(0.0, 0.3)),
                     clip_eps_high=draw(st.floats(0.0, 0.3)))
        else:
            o.update(clip_eps_low=draw(st.floats(0.0, 0.5)),
                     clip_eps_high=draw(st.floats(0.0, 0.5)))
        if pl in ("vanilla", "gspo", "gspo-token") and draw(st.booleans()):
            o["dual_clip_c"] = 1.0 + o["clip_eps_high"] + draw(st.floats(0.1, 3.0))
        if draw(st.booleans()):
            o.update(kl_coef=draw(st.floats(0.0, 0.5)),
                     kl_estimator=draw(st.sampled_from(("k1", "k2", "k3", "abs", "k1+", "k3+"))),
                     kl_bias_correction=draw(st.booleans()))
        o["entropy_coef"] = draw(st.sampled_from((0.0, 0.01, -0.02)))
        o["temperature"] = draw(st.sampled_from((1.0, 0.7, 1.3)))
        o["loss_agg_mode"] = draw(st.sampled_from(("token-mean", "token-sum",
                                                   "seq-mean-token-sum", "seq-mean-token-mean",
                                                   "seq-mean-token-sum-norm", "none")))
        if with_rollout and pl != "vespo" and draw(st.booleans()):
            o["rollout_correction"] = draw(st.sampled_from(("tis", "tis-seq", "mis",
                                                            "mis-seq", "geo-seq")))
        return o

    return opts()


# ------------------------------------------------------------------ comparisons

def _call_kwargs(batch, options):
    """Splits a make_batch dict and options into ppo_loss's positional inputs and keywords
    (ref_logprobs only when a KL term reads it; rollout_logprobs only when asked)."""
    options = dict(options or {})
    b = dict(batch)
    kw = {}
    if options.get("kl_coef", 0.0) or options.pop("with_ref", False):
        kw["ref_logprobs"] = b.get("ref_logprobs")
    if options.get("rollout_correction") or options.pop("with_rollout", False):
        kw["rollout_logprobs"] = b.get("rollout_logprobs")
    if "cu_seqlens" in b:
        kw["cu_seqlens"] = b["cu_seqlens"]
    old = options.pop("old_logprobs", b["old_logprobs"])
    args = (b["logits"], b["tokens"], old, b["advantages"], b["response_mask"])
    kw.update(options)
    return args, kw


def _close(got, want, tol, what):
    g = got.detach().double().cpu()
    w = want.double()
    if g.shape != w.shape:
        raise AssertionError(f"{what}: shape {tuple(g.shape)} != reference {tuple(w.shape)}")
    if not torch.isfinite(g).all() and torch.isfinite(w).all():
        raise AssertionError(f"{what}: non-finite values where the reference is finite")
    err = (g - w).abs().nan_to_num(0.0)
    bound = tol * torch.clamp(w.abs(), min=1.0)
    if (err > bound).any():
        raise AssertionError(f"{what}: max |error| {float(err.max()):.3e}, allowed "
                             f"{tol:.1e} * max(1, |reference|)")


def assert_matches_reference(options=None, *, backend="cpu", dtype=torch.float32,
                             shape=(2, 5, 11), kind="random", seed=0, batch=None,
                             tol=None, device="cpu"):
    """Runs pk.ppo_loss(**options) on ``backend`` and the float64 reference on the same
    (rounded) inputs, and asserts loss, metrics and gradient agree within ``tol`` (default
    tolerance(dtype, backend)).

    Args:
        options: pk.ppo_loss keywords (policy_loss, kl_coef, loss_agg_mode, ...); also
            old_logprobs=None (on-policy), with_ref / with_rollout=True to pass the batch's
            ref / rollout log-probs without a KL term / correction.
        backend: "cpu" | "torch" | "triton" | "cuda". dtype: the logits' dtype.
        shape: (B, T, V) of make_batch. kind, seed: make_batch's. batch: your own
            make_batch-like dict instead (logits, tokens, old_logprobs, advantages,
            response_mask[, ref_logprobs, rollout_logprobs, cu_seqlens]).
        device: where the batch goes ("cuda" for the GPU backends).

    Returns:
        (loss, metrics, grad) of the op, for more checks of your own.

    Raises:
        AssertionError naming what differs (loss, metric name, dlogits) and by how much.
    """
    import ppo_kernels as pk

    if batch is None:
        B, T, V = shape
        batch = make_batch(B, T, V, kind=kind, seed=seed, dtype=dtype, device=device)
    tol = tol or tolerance(dtype, backend)
    args, kw = _call_kwargs(batch, options)
    leaf = args[0].detach().clone().requires_grad_(True)
    loss, metrics = pk.ppo_loss(leaf, *args[1:], backend=backend, **kw)
    (loss.sum() if loss.dim() else loss).backward()
    ref_args = (args[0].detach().double(),) + args[1:]
    want = reference_ppo_loss(*ref_args, **kw)
    _close(loss, want.loss, tol.loss, "loss")
    for k, v in want.metrics.items():
        if k not in metrics:
            raise AssertionError(f"metrics: {k!r} missing from ppo_loss's metrics")
        _close(metrics[k], v, tol.metrics, f"metric {k}")
    g, w = leaf.grad.detach().double().cpu(), want.grad
    if g.shape != w.shape:
        raise AssertionError(f"dlogits: shape {tuple(g.shape)} != {tuple(w.shape)}")
    scale = float(w.abs().max()) if w.numel() else 0.0
    err = float((g - w).abs().max()) if w.numel() else 0.0
    if not (err <= tol.grad * scale + 1e-30):
        raise AssertionError(f"dlogits: max |error| {err:.3e}, allowed {tol.grad:.1e} * "
                             f"{scale:.3e} (the largest reference entry)")
    return loss, metrics, leaf.grad


# ------------------------------------------------------------------ differentiability

# (what is stop-gradient, when, why, source): the parts of the loss whose gradient is not
# the derivative of its value, by design. Under these options torch.autograd.gradcheck of
# the loss fails by construction; gradcheck() below checks them against the reference's
# analytic gradient and the finite differences of a frozen-weight surrogate instead.
STOP_GRADIENTS = (
    ("old_logprobs=None", "the ratio's denominator: rho = exp(logp - sg(logp)) (value 1, "
     "gradient that of logp)", "on-policy GRPO: verl's on-policy old_log_prob = "
     "log_prob.detach(); TRL's GRPOTrainer with num_iterations=1"),
    ("policy_loss='cispo'", "the clipped weight sg(clip(rho, 1 - eps_low, 1 + eps_high))",
     "MiniMax-M1 (arXiv 2506.13585), eq. 4; TRL loss_type='cispo'"),
    ("policy_loss='gspo-token'", "the sequence ratio s in s_t = sg(s) exp(logp_t - "
     "sg(logp_t))", "GSPO (Zheng et al. 2025, arXiv 2507.18071), GSPO-token; verl 'gspo'"),
    ("policy_loss='vespo'", "the weight sg(phi(w)) of the sequence ratio",
     "VESPO (arXiv 2602.10693); TRL get_gamma_weights under no_grad"),
    ("policy_loss='dppo-tv' / 'dppo-kl'", "the trust-region mask M and sg(min(rho, c))",
     "Qi et al. 2026; verl dppo_tv / dppo_kl"),
    ("kl_estimator='k1+' / 'k3+'", "straight-through: the value of k1 / k3, the gradient "
     "of k2", "verl kl_penalty 'k1+' / 'k3+' (low_var_kl straight-through)"),
    ("rollout_correction / rollout_is_weights / off_policy_mask_threshold", "the weights "
     "and masks (computed from data and sg(logp))", "verl rollout_corr; TRL vLLM IS; "
     "DeepSeek-V3.2 off-policy sequence masking"),
)


def stop_gradients(options=None, *, on_policy=False):
    """The STOP_GRADIENTS rows (their first field) that apply to ``options`` (ppo_loss
    keywords; on_policy=True: old_logprobs=None). [] means the loss's gradient is the
    derivative of its value, so torch.autograd.gradcheck of the loss applies."""
    o = dict(options or {})
    out = []
    if on_policy or ("old_logprobs" in o and o["old_logprobs"] is None):
        out.append(STOP_GRADIENTS[0][0])
    pl = o.get("policy_loss", "vanilla")
    if pl == "cispo":
        out.append(STOP_GRADIENTS[1][0])
    elif pl == "gspo-token":
        out.append(STOP_GRADIENTS[2][0])
    elif pl == "vespo":
        out.append(STOP_GRADIENTS[3][0])
    elif pl in ("dppo-tv", "dppo-kl"):
        out.append(STOP_GRADIENTS[4][0])
    if o.get("kl_coef", 0.0) and o.get("kl_estimator", "k3") in ("k1+", "k3+"):
        out.append(STOP_GRADIENTS[5][0])
    if any(o.get(k) is not None for k in ("rollout_correction", "off_policy_mask_threshold")):
        out.append(STOP_GRADIENTS[6][0])
    return out


def gradcheck(options=None, *, backend="cpu", shape=(2, 3, 5), seed=0, kind="random"):
    """Checks the gradient of pk.ppo_loss(**options) with respect to the logits, in
    float64, knowing which parts are stop-gradient by design (stop_gradients):

    - none: torch.autograd.gradcheck of the op itself (its backward against central
      finite differences of its forward);
    - some: the op's gradient against the reference's analytic gradient (rel. 1e-8), and
      that gradient against central finite differences of the frozen-weight surrogate
      where one is a public option away: the on-policy ratio as old_logprobs = sg(logp)
      frozen at the current logits, k1+ / k3+ as k2 (the other stop-gradient losses' frozen
      surrogates are checked in the project's tests/test_reference.py).

    Returns the list of stop-gradient rows that applied. Raises AssertionError (or
    torch.autograd.gradcheck's GradcheckError) on a mismatch."""
    import ppo_kernels as pk

    B, T, V = shape
    batch = make_batch(B, T, V, kind=kind, seed=seed, dtype=torch.float64)
    options = dict(options or {})
    sg = stop_gradients(options)
    args, kw = _call_kwargs(batch, options)
    x0 = args[0].detach().clone()

    def f(x):
        loss, _ = pk.ppo_loss(x, *args[1:], backend=backend, **kw)
        return loss

    if not sg:
        torch.autograd.gradcheck(f, (x0.clone().requires_grad_(True),), eps=1e-6,
                                 atol=1e-7, rtol=1e-5)
        return sg
    leaf = x0.clone().requires_grad_(True)
    loss = f(leaf)
    (loss.sum() if loss.dim() else loss).backward()
    want = reference_ppo_loss(x0, *args[1:], **kw).grad
    scale = float(want.abs().max())
    err = float((leaf.grad - want).abs().max())
    if not err <= 1e-8 * scale + 1e-30:
        raise AssertionError(f"dlogits vs the reference's analytic gradient: {err:.3e} "
                             f"(scale {scale:.3e}); stop-gradient parts: {sg}")
    sur_args, sur_kw = list(args), dict(kw)
    if args[2] is None:
        lp, _ = _ref.token_logprobs(x0.numpy(), np.where(
            args[4].numpy(), args[1].numpy(), 0), args[4].numpy(), kw.get("temperature", 1.0))
        sur_args[2] = torch.from_numpy(lp)
    if sur_kw.get("kl_estimator") in ("k1+", "k3+"):
        sur_kw["kl_estimator"] = "k2"
    value_diff = [s for s in stop_gradients(dict(sur_kw, old_logprobs=sur_args[2]))]
    if not value_diff:  # the surrogate's value is differentiable: finite differences
        def g(x):
            out = reference_ppo_loss(x, *sur_args[1:], **sur_kw).loss
            return float(out.sum())
        h = 1e-6
        xf = x0.numpy().copy()
        num = np.zeros_like(xf)
        it = np.nditer(xf, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            xp, xm = xf.copy(), xf.copy()
            xp[i] += h
            xm[i] -= h
            num[i] = (g(torch.from_numpy(xp)) - g(torch.from_numpy(xm))) / (2 * h)
        nerr = float(np.abs(num - want.numpy()).max())
        if not nerr <= 1e-6 * max(scale, 1e-3):
            raise AssertionError(f"reference gradient vs finite differences of the frozen "
                                 f"surrogate: {nerr:.3e} (scale {scale:.3e})")
    return sg


# ------------------------------------------------------------------ raw ops: opcheck

# the raw ops with an autograd formula (ppo_kernels/_autograd.py); the others run under
# no_grad or are backward / in-place ops
DIFFERENTIABLE_OPS = ("ppo_loss_fwd", "token_logprobs_fwd", "distill_fwd")


def registered_ops(prefix=""):
    """The names of the ppo_kernels ops registered with the dispatcher whose name starts
    with ``prefix`` ("" : every op of the C++ extension, the Triton ones excluded;
    "triton_": the Triton ops, once ppo_kernels.triton_kernels.library is imported)."""
    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("ppo_kernels::"))
    if prefix:
        return [n for n in names if n.startswith(prefix)]
    return [n for n in names if not n.startswith("triton_")]


def opcheck_arguments(op, options=None, *, shape=(3, 5, 37), seed=0, requires_grad=True,
                      device="cpu", temperatures=False):
    """(args, kwargs) of the raw op ``torch.ops.ppo_kernels.<op>`` built from public
    options, as ppo_loss / token_logprobs / gae / score_rollout / distill_loss would call
    it: the scalars and codes of ppo_loss_fwd from LossSpec.build(**options).kernel_args,
    the aggregation weights of options' loss_agg_mode, a make_batch batch of ``shape``.
    requires_grad: the logits require grad (DIFFERENTIABLE_OPS only: the ops with an
        autograd formula).
    temperatures: also pass a per-row temperature [B, T] (the ops that take one).

    Raises ValueError naming ``op`` for an op it does not know."""
    from .spec import LossSpec

    B, T, V = shape
    b = make_batch(B, T, V, seed=seed, device=device)
    options = dict(options or {})
    options.setdefault("kl_coef", 0.1)
    options.setdefault("entropy_coef", 0.01)
    agg = options.get("loss_agg_mode", "token-mean")
    if agg == "none":
        raise ValueError("options: loss_agg_mode='none' has no kernel op (per-token losses "
                         "go through token_logprobs_fwd)")
    logits = b["logits"].clone()
    tok, mask = b["tokens"].clone(), b["response_mask"]
    tok = torch.where(mask, tok, 0)
    w = torch.as_tensor(_ref.agg_weights(mask.cpu(), agg), dtype=torch.float32).to(device)
    spec = LossSpec.build(**{k: v for k, v in options.items()
                             if k not in ("backend",)})
    scalars, codes = spec.kernel_args(logits.dtype)
    g = torch.Generator().manual_seed(seed + 1)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    tt = (torch.where(mask, 0.5 + torch.rand(B, T, generator=g).to(device), 1.0)
          if temperatures else None)
    kw = {"temperatures": tt} if temperatures else {}
    # only the ops with an autograd formula take logits that require grad
    lg = logits.clone().requires_grad_(requires_grad and op in DIFFERENTIABLE_OPS)
    loss_in = (tok, mask, b["old_logprobs"], b["advantages"], w,
               b["ref_logprobs"] if spec.kl_coef else None, None,
               w * 0.5 if options.get("entropy_agg_mode") else None, scalars, codes)
    temp = float(spec.temperature)
    if op == "ppo_loss_fwd":
        return (lg, *loss_in, True), kw
    if op == "ppo_loss_fwd_inplace":
        return (logits.clone(), *loss_in), kw
    if op == "token_logprobs_fwd":
        return (lg, tok, mask, temp, True), kw
    ops = torch.ops.ppo_kernels
    if op == "token_logprobs_bwd":
        _, ent, mx, ls = ops.token_logprobs_fwd(logits, tok, mask, temp, True, **kw)
        return (rnd(B, T), rnd(B, T), logits, tok, mask, mx, ls, ent, temp), kw
    if op == "scale_grad_":
        return (logits.clone(), torch.tensor(0.25, device=device),
                torch.tensor(spec.grad_scale, device=device)), {}
    if op == "zeros_grad":
        return (logits,), {}
    if op == "gae":
        return (rnd(B, T), rnd(B, T), mask, rnd(B), 0.99, 0.95), {}
    if op == "score_rollout":
        return (logits, tok, mask, b["ref_logprobs"], rnd(B, T), rnd(B), 0.05,
                spec.kl_estimator_id, 0.99, 0.95, temp), kw
    if op in ("sampling_threshold", "kept_logprobs_fwd", "kept_logprobs_bwd_",
              "kept_logprobs_bwd", "threshold_kept_fwd"):
        top_k = torch.full((B, T), max(1, V // 3), dtype=torch.int64, device=device)
        top_p = torch.full((B, T), 0.9, dtype=torch.float64, device=device)
        thr = ops.sampling_threshold(logits, mask, temp, top_k, top_p, None, **kw)
        if op == "sampling_threshold":
            return (lg, mask, temp, top_k, top_p, None), kw
        if op == "threshold_kept_fwd":
            return (lg, tok, mask, temp, top_k, top_p, None), kw
        if op == "kept_logprobs_fwd":
            return (lg, tok, mask, temp, None, None, thr), kw
        _, ent, kmax, kls, _, _ = ops.kept_logprobs_fwd(logits, tok, mask, temp, None, None,
                                                        thr, **kw)
        args = (rnd(B, T), rnd(B, T), logits, tok, mask, kmax, kls, ent, temp, None, None, thr)
        return (args if op == "kept_logprobs_bwd" else args + (torch.zeros_like(logits),)), kw
    if op == "ppo_loss_metrics":  # (the loss's per-token outputs stand in as a batch's)
        from .loss import METRIC_SLOTS
        lp, ent, _, _ = ops.token_logprobs_fwd(logits, tok, mask, temp, True, **kw)
        return (lp, ent, mask, b["old_logprobs"], b["advantages"], b["ref_logprobs"],
                b["old_logprobs"] + 0.1 * rnd(B, T), w * 0.5 + 0.5, scalars, codes,
                list(range(len(METRIC_SLOTS)))), {}
    if op == "agg_weights":
        return (mask, 3, 0.0, False), {}
    if op == "check_kept_ids":  # (three ids a position, every id of a row distinct)
        ids = (torch.arange(B * T, device=device)[:, None] + torch.arange(3, device=device)) % V
        return (ids.reshape(-1), torch.arange(0, B * T * 3 + 1, 3, device=device), V), {}
    if op == "seq_loss_grad":  # (GSPO's middle: the policy_loss of options, else gspo)
        if spec.policy_loss not in ("gspo", "gspo-token"):
            spec = LossSpec.build(**{**{k: v for k, v in options.items() if k != "backend"},
                                     "policy_loss": "gspo"})
        scalars, codes = spec.kernel_args(logits.dtype)
        lp, ent, _, _ = ops.token_logprobs_fwd(logits, tok, mask, temp, True, **kw)
        return (lp, ent, mask, b["old_logprobs"], b["advantages"],
                b["ref_logprobs"] if spec.kl_coef else None, w * 0.5 + 0.5, w,
                w * 0.5 if options.get("entropy_agg_mode") else None, scalars, codes), {}
    if op == "token_loss_grad":  # (a kept set's middle: the KL on the full log-probs)
        lp, ent, _, _ = ops.token_logprobs_fwd(logits, tok, mask, temp, True, **kw)
        return (lp, ent, mask, b["old_logprobs"], b["advantages"],
                b["ref_logprobs"] if spec.kl_coef else None, w * 0.5 + 0.5, w,
                w * 0.5 if options.get("entropy_agg_mode") else None, scalars, codes,
                lp + 0.1 * rnd(B, T)), {}
    if op == "distill_fwd":
        from . import _autograd
        _autograd.register_distill("")
        k = 3
        n = B * T
        offsets = torch.arange(0, n * k + 1, k, dtype=torch.int64, device=device)
        ids = torch.randint(0, V, (n * k,), generator=g).to(device)
        teacher = torch.log_softmax(rnd(n, k), -1).reshape(-1)
        return (lg, mask, offsets, ids, teacher, w, temp, spec.grad_scale, True, True), {}
    raise ValueError(f"op: no arguments known for ppo_kernels::{op} (known: "
                     f"{registered_ops()})")


def opcheck(op, options=None, *, requires_grad=True, test_utils=None, **kw):
    """torch.library.opcheck of torch.ops.ppo_kernels.<op> on opcheck_arguments(op,
    options, requires_grad=..., **kw), with opcheck's default checks (test_schema,
    test_autograd_registration, test_faketensor, test_aot_dispatch_dynamic) unless
    test_utils names others. Returns opcheck's {check: "SUCCESS"} dict; raises its
    OpCheckError on a failure."""
    args, kwargs = opcheck_arguments(op, options, requires_grad=requires_grad, **kw)
    fn = getattr(torch.ops.ppo_kernels, op).default
    if test_utils is None:
        return torch.library.opcheck(fn, args, kwargs)
    return torch.library.opcheck(fn, args, kwargs, test_utils=test_utils)


# (the names of these tables, for `from ppo_kernels.testing import *` users)
TOKEN_POLICY_LOSSES = KERNEL_POLICY_LOSSES
SEQUENCE_LOSSES = SEQUENCE_POLICY_LOSSES
