"""Sampling replay: train on the distribution the inference engine sampled from.

Inference engines sample from a truncated distribution (min-p, top-k, top-p after the
temperature) and report log-probs renormalised over the kept set (vLLM's
``logprobs_mode="processed_logprobs"``; ``--return-sampling-mask`` gives the kept set of
every token as CSR ids + offsets). A trainer that recomputes log-probs over the full
vocabulary carries log(kept mass) into every ratio against those numbers. With a kept set
the ops compute, from the same pass over the logits, both

    logp_kept_t = z_y - logsumexp_{j in K_t} z_j      and     logp_t = z_y - logsumexp_v z_v

(z = logits / temperature). The policy ratio uses logp_kept; the KL to the reference and
the entropy use the full distribution unless ``kl_logprobs="kept"`` / ``entropy_over="kept"``
(docs/SAMPLING.md). The kept set K_t is

- given: ``SamplingMask(token_ids, offsets)``, CSR over the N = B * T positions in row-major
  order, global vocabulary ids; or
- re-derived from ``top_k`` / ``top_p`` / ``min_p`` (numbers or per-sequence [B] tensors)
  with vLLM v1's sampler rules as value thresholds on the row (kept.threshold_torch).

The sampled token is always in K_t (a given set that lacks it gets it added, counted in
the metric ``mask_missing_token_frac``), so no log-prob is -inf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from . import _checks as ck
# (the Triton threshold kernel's torch fallback, triton_kernels/sampling.py, imports it
# from here)
from .kept import threshold_torch  # noqa: F401


class SamplingMask(NamedTuple):
    """The kept set of every position, CSR over the N = B * T positions (row-major; with
    cu_seqlens the packed positions in order).

    token_ids: integer [nnz], global vocabulary ids in [0, V), unique within a row.
    offsets: integer [N + 1], offsets[0] = 0, non-decreasing, offsets[N] = nnz; row i keeps
        token_ids[offsets[i]:offsets[i + 1]] (masked positions may keep nothing).
    """

    token_ids: Any
    offsets: Any


class Replay(NamedTuple):
    """The checked kept-set inputs of a call, in the kernels' row layout [B, T] (packed
    [1, total] with cu_seqlens). Either ids + offsets (int64 CSR) or the re-derivation's
    per-row parameters (top_k int64 [B, T], V = off; top_p float64 [B, T], 1 = off; min_p
    float64 [B, T], 0 = off; each None when not asked for)."""

    ids: Any = None
    offsets: Any = None
    top_k: Any = None
    top_p: Any = None
    min_p: Any = None

    @property
    def given(self):
        return self.ids is not None


KL_LOGPROBS = ("full", "kept")
ENTROPY_OVER = ("full", "kept")


def _per_row(name, value, tokens2, dtype, check, per_seq=None):
    """A number or a per-sequence [B] tensor as [B, T] of dtype; check(v) -> ok for numbers,
    applied to every entry of a tensor (a host read on CPU; on a device an asynchronous
    assertion)."""
    b, t = tokens2.shape
    if isinstance(value, torch.Tensor):
        ck.same_device(name, value, "tokens", tokens2)
        if value.dtype == torch.bool or value.dtype.is_complex:
            raise TypeError(f"{name}: expected a real tensor, got dtype {value.dtype}")
        if dtype == torch.int64 and value.dtype.is_floating_point:
            raise TypeError(f"{name}: expected an integer tensor, got dtype {value.dtype}")
        v = value.reshape(-1)
        if per_seq is not None:
            if v.shape[0] != per_seq.num_seqs:
                raise ValueError(f"{name}: expected one value per sequence, [{per_seq.num_seqs}]"
                                 f" (the sequences of cu_seqlens), got {list(value.shape)}")
            out = per_seq.per_seq(v.to(dtype))
        else:
            if tuple(value.shape) not in ((b,), (b, 1)):
                raise ValueError(f"{name}: expected a number or one value per sequence, [{b}],"
                                 f" got shape {list(value.shape)}")
            out = v.to(dtype)[:, None].expand(b, t)
        ok, what = check(v.to(torch.float64))
        if v.device.type == "cpu":
            if v.numel() and not bool(ok.all()):
                bad = v[~ok][0].item()
                raise ValueError(f"{name}: every entry must be {what}, got {bad!r}")
        else:
            torch._assert_async(ok.all(), f"{name}: every entry must be {what}")
        return out.contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number or a [B] tensor, got "
                        f"{type(value).__name__}")
    try:
        f = float(value)
    except OverflowError:  # an int past float64's range is checked as the infinity it is
        f = float("inf")
    ok, what = check(torch.tensor([f], dtype=torch.float64))
    if not bool(ok.all()):
        raise ValueError(f"{name}: expected {what}, got {value!r}")
    if not dtype.is_floating_point:  # (top_k: any k >= V is V, off; 2**63 is no int64)
        value = min(value, torch.iinfo(dtype).max)
    return torch.full((b, t), value, dtype=dtype, device=tokens2.device)


def _top_k_ok(v):
    return (v >= 1) & (v == v.floor()), "an integer >= 1"


def _top_p_ok(v):
    return (v > 0) & (v <= 1), "in (0, 1]"


def _min_p_ok(v):
    return (v >= 0) & (v < 1), "in [0, 1)"


def check_outputs(rp, return_full, entropy_over):
    """token_logprobs(_from_hidden)'s replay switches, against the kept sets rp (None: no
    kept set): return_full a bool that needs a kept set, entropy_over in ENTROPY_OVER."""
    ck.flag("return_full", return_full)
    ck.choice("entropy_over", entropy_over, ENTROPY_OVER)
    if rp is None and return_full:
        raise ValueError("return_full: only with a kept set (sampling_mask, top_k, top_p "
                         "or min_p)")


def outputs(lp_k, ent_k, logp, ent, return_full, return_entropy, entropy_over, shape=None):
    """What token_logprobs(_from_hidden) return with a kept set: logp_kept, then the full
    logp (return_full), then the entropy (return_entropy; over the kept set with
    entropy_over="kept"), each through shape (the caller's output layout) when given."""
    out = (lp_k, logp) if return_full else (lp_k,)
    if return_entropy:
        out = out + (ent_k if entropy_over == "kept" else ent,)
    if shape is not None:
        out = tuple(shape(v) for v in out)
    return out if len(out) > 1 else out[0]


# A given kept set's rules, in the order they are checked (the CPU op check_kept_ids, the
# eager checks and triton_kernels/csr_check.py raise these; {vocab} the global V)
CSR_RULES = ("sampling_mask.offsets: must start at 0 and end at nnz = len(token_ids)",
             "sampling_mask.offsets: must be non-decreasing",
             "sampling_mask.token_ids: ids must lie in [0, V) = [0, {vocab})",
             "sampling_mask.token_ids: an id repeats within a row (the sets must be sets)")


def _csr_kernel_applies(n, vocab):
    """Whether triton_kernels/csr_check.py checks a kept set of n positions (on the device
    path, where triton is importable: _backends.device_eager): V known (a split
    vocabulary's ids are checked against its global size by the merge) and one program per
    position within a launch's grid."""
    return vocab is not None and 0 < n < 2**31 - 1


def csr_check_op():
    """ppo_kernels::check_kept_ids (csrc/cpu/sampling.cpp) where this build has it, else
    None (check_replay's eager checks)."""
    ops = torch.ops.ppo_kernels
    return ops.check_kept_ids if hasattr(ops, "check_kept_ids") else None


def check_replay(sampling_mask, top_k, top_p, min_p, tokens2, vocab, packing=None,
                 device=False):
    """The Replay of a call (None without a kept set). tokens2: the kernels' [B, T] (packed
    [1, total]); vocab: the global V (None: not checked here, a split vocabulary checks the
    ids against its global size itself). Every bad value a ValueError / TypeError naming
    the argument (on a device the checks that read device memory are asynchronous
    assertions). device: the call's [B, T] work runs as Triton launches
    (_backends.device_eager): a given set's CSR is checked by one kernel
    (triton_kernels/csr_check.py) instead of about 25 torch ops."""
    derived = (top_k, top_p, min_p) != (None, None, None)
    if sampling_mask is None and not derived:
        return None
    if sampling_mask is not None and derived:
        raise ValueError("sampling_mask: give the kept sets (sampling_mask) or the sampling "
                         "parameters to re-derive them (top_k / top_p / min_p), not both")
    n = tokens2.numel()
    if sampling_mask is not None:
        if not (isinstance(sampling_mask, tuple) and len(sampling_mask) == 2):
            raise TypeError(f"sampling_mask: expected a pk.SamplingMask(token_ids, offsets), "
                            f"got {type(sampling_mask).__name__}")
        ids, offs = sampling_mask
        ck.tensor("sampling_mask.token_ids", ids, integer=True)
        ck.tensor("sampling_mask.offsets", offs, integer=True)
        ck.same_device("sampling_mask.token_ids", ids, "tokens", tokens2)
        ck.same_device("sampling_mask.offsets", offs, "tokens", tokens2)
        if ids.dim() != 1:
            raise ValueError(f"sampling_mask.token_ids: expected a 1-D tensor [nnz], got shape "
                             f"{list(ids.shape)}")
        if offs.dim() != 1 or offs.shape[0] != n + 1:
            raise ValueError(f"sampling_mask.offsets: expected [N + 1] = [{n + 1}] for the "
                             f"N = {n} positions of tokens, got shape {list(offs.shape)} (a "
                             f"mask for the wrong number of positions)")
        ids, offs = ids.long().contiguous(), offs.long().contiguous()
        nnz = ids.shape[0]
        on_host = ck.host_readable(ids)
        op = csr_check_op() if on_host else None
        if op is not None:  # every rule below in one pass of the CPU op, the same ValueErrors
            op(ids, offs, -1 if vocab is None else int(vocab))
            return Replay(ids=ids, offsets=offs)
        rules = [r.format(vocab=vocab) for r in CSR_RULES]
        if device and not on_host and _csr_kernel_applies(n, vocab):
            # three rules' flags and the sort keys from one launch; a repeat within a row
            # two equal neighbours among the sorted keys
            from .triton_kernels import csr_check
            flags, keys = csr_check.csr_check(ids, offs, int(vocab))
            for k in range(csr_check.FLAGS):
                torch._assert_async(flags[k], rules[k])
            if nnz > 1:
                srt = keys.sort().values
                torch._assert_async((srt[1:] != srt[:-1]).all(), rules[3])
            return Replay(ids=ids, offsets=offs)
        conds = [((offs[:1] == 0).all() & (offs[-1:] == nnz).all(), rules[0]),
                 ((offs[1:] >= offs[:-1]).all(), rules[1])]
        if vocab is not None:
            conds.append((((ids >= 0) & (ids < vocab)).all(), rules[2]))
        if on_host:
            for ok, msg in conds:
                if not bool(ok):
                    raise ValueError(msg)
        else:
            for ok, msg in conds:
                torch._assert_async(ok, msg)
        # unique within a row: sorted by (row, id), no two neighbours equal
        row = torch.repeat_interleave(torch.arange(n, device=ids.device),
                                      (offs[1:] - offs[:-1]).clamp(min=0), output_size=nnz)
        if nnz > 1:
            width = int(vocab) if vocab is not None else int(ids.max()) + 1
            srt = (row * width + ids).sort().values
            dup = (srt[1:] == srt[:-1]).any()
            msg = rules[3]
            if on_host:
                if bool(dup):
                    raise ValueError(msg)
            else:
                torch._assert_async(~dup, msg)
        return Replay(ids=ids, offsets=offs)
    k = p = mp = None
    if top_k is not None:
        k = _per_row("top_k", top_k, tokens2, torch.int64, _top_k_ok, packing)
        if vocab is not None:
            k = k.clamp(max=vocab)
    if top_p is not None:
        p = _per_row("top_p", top_p, tokens2, torch.float64, _top_p_ok, packing)
    if min_p is not None:
        mp = _per_row("min_p", min_p, tokens2, torch.float64, _min_p_ok, packing)
    return Replay(top_k=k, top_p=p, min_p=mp)


def replay_metrics(mass, size, missing, mask):
    """kept_mass, kept_size_mean, mask_missing_token_frac: means over the valid tokens (0
    where there are none), float32 0-d tensors."""
    with torch.no_grad():
        m = mask
        n = m.sum().clamp(min=1)

        def mean(x):
            return (torch.where(m, x.double(), 0.0).sum() / n).float()

        return {"kept_mass": mean(mass), "kept_size_mean": mean(size),
                "mask_missing_token_frac": mean(missing)}
