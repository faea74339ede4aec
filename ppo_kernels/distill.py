"""Top-k distillation loss (on-policy distillation from a teacher's top-k log-probs).

Per position i, with the teacher's log-probs lT_j on a set S_i of vocabulary ids
(pT_j = exp(lT_j), PT = sum_S pT) and the student's softmax pS = softmax(logits / temperature)
(PS = sum_S pS), the forward KL from the teacher's top-k distribution to the student's:

    kl_i = sum_{j in S_i} pT_j (lT_j - log pS_j)
           + [tail] (1 - PT) (log(1 - PT) - log(1 - PS))

the tail bucket lumping every id outside S into one outcome (so that the two distributions
over |S| + 1 outcomes are both normalised). Sources: GKD, Agarwal et al. 2023,
arXiv:2306.13649 (the forward-KL case of the generalised JSD on the student's own samples);
on-policy distillation in verl (https://github.com/volcengine/verl) and open-instruct
(https://github.com/allenai/open-instruct), and Thinking Machines' "On-Policy Distillation"
(2025), which train on the teacher's top-k log-probs. The gradient with respect to
z = logits / temperature is

    d kl_i / d z_v = alpha pS_v + [v in S] (beta pS_v - pT_v),
    tail: alpha = 1 - r, beta = r, r = (1 - PT) / (1 - PS);   no tail: alpha = PT, beta = 0

(in S: pS_v - pT_v with the tail), written by the kernels in the forward pass, as for
ppo_loss. Numerics: log pS_j from the row's max and log1p of its non-top mass (as every
kernel of the package); the student's complement 1 - PS summed over the entries outside S
(never 1 - PS: no cancellation when the set holds nearly all the student's mass); the
teacher's log(1 - PT) as log1p(-PT); a set holding the whole vocabulary, or one whose
teacher mass reaches 1, has no tail; an empty set gives kl = 0.

The teacher's sets travel as ``SparseLogprobs``, a CSR over the N = B * T positions in
row-major order. ``check_csr`` holds the layout checks, written to be shared with other
CSR inputs (token_ids, offsets).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch

from . import _checks as ck
from . import packed
from ._autograd import register_distill, wants_grad
from ._backends import get_backend
from ._torch_impl import agg_weights
from .spec import LOSS_AGG_MODES

# a set's teacher mass may exceed 1 by this much (rounding of the teacher's log-probs:
# bf16 / fp32 log_softmax over a whole vocabulary) before it is an error
MASS_TOLERANCE = 1e-3


class SparseLogprobs(NamedTuple):
    """A teacher's log-probs on a set of vocabulary ids per position, in CSR over the
    N = B * T positions in row-major order (position i = b * T + t).

    token_ids: integer [nnz], global vocabulary ids, distinct within a position.
    offsets: int64 [N + 1], non-decreasing, offsets[0] = 0, offsets[N] = nnz; position i's
        entries are token_ids[offsets[i]:offsets[i + 1]].
    logprobs: float [nnz], the teacher's log-probabilities (nats, <= 0) of those ids.
    """

    token_ids: Any
    offsets: Any
    logprobs: Any


def _first_bad(bad):
    return int(bad.nonzero()[0, 0])


@contextlib.contextmanager
def _one_thread():
    """The CPU checks' ATen ops on one intra-op thread. Each is one memory-bound pass over
    the [nnz] entries (tens of microseconds at a top-64 teacher's N * k = 65536); above
    ATen's grain size (32768 elements) each would be a parallel region whose threads must
    all be scheduled, which on a loaded machine costs a scheduler time slice per op
    (milliseconds: measured 270 ms for the checks at 2 threads against 1 ms at 1, N 1024,
    k 64). The kernel's one long parallel region keeps every thread."""
    t = torch.get_num_threads()
    if t == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(t)


class _Csr(NamedTuple):
    """A checked CSR: ids, off int64; row_of int64 [nnz] (each entry's position); valid_e
    bool [nnz] (its position is valid) or None (every position valid, or no mask given;
    CPU only: on a device always the tensor when a mask is given); counts [n] (the
    entries per position, >= 0)."""

    ids: Any
    off: Any
    row_of: Any
    valid_e: Any
    counts: Any


def check_csr(name, token_ids, offsets, n, like, *, vocab=None, row_valid=None,
              distinct=True):
    """Checks a CSR (token_ids [nnz], offsets [N + 1]) over n positions and returns
    (token_ids int64, offsets int64, row_of int64 [nnz]: each entry's position).

    name: the record's name in messages ("teacher" gives "teacher.offsets"). like: a
    tensor of the device they must share. vocab: ids must lie in [0, vocab); row_valid
    (bool [n]): only the entries of valid positions are checked for range and
    distinctness (masked positions are never read). On CPU tensors every failure is a
    ValueError / TypeError naming the field; on a device the value checks are
    asynchronous device assertions (no host read) and bad ids are replaced by 0."""
    return _check_csr(name, token_ids, offsets, n, like, vocab, row_valid, distinct)[:3]


def _check_csr(name, token_ids, offsets, n, like, vocab, row_valid, distinct):
    ck.tensor(f"{name}.token_ids", token_ids, integer=True)
    ck.tensor(f"{name}.offsets", offsets, integer=True)
    for f, x in (("token_ids", token_ids), ("offsets", offsets)):
        ck.same_device(f"{name}.{f}", x, "logits", like)
        if x.dim() != 1:
            raise ValueError(f"{name}.{f}: expected a 1-D tensor, got shape {list(x.shape)}")
    if offsets.numel() != n + 1:
        raise ValueError(f"{name}.offsets: expected N + 1 = {n + 1} entries (N = {n} "
                         f"positions), got {offsets.numel()}")
    ids = token_ids.long().contiguous()
    off = offsets.long().contiguous()
    counts = off[1:] - off[:-1]
    if ck.host_readable(off):
        with _one_thread():
            return _csr_on_host(name, ids, off, counts, n, vocab, row_valid, distinct)
    return _csr_on_device(name, ids, off, counts, n, vocab, row_valid, distinct)


def _csr_on_host(name, ids, off, counts, n, vocab, row_valid, distinct):
    """check_csr on CPU tensors: one pass per question over the [nnz] entries (the range as
    one aminmax, distinctness as one sort of row * span + id keys: a radix sort, int32
    where the keys fit), a few numbers read; the messages' details (the first bad entry)
    are computed only on the way to raising."""
    nnz = ids.numel()
    first, last = off[0].item(), off[-1].item()
    if first != 0:
        raise ValueError(f"{name}.offsets: expected offsets[0] = 0, got {first}")
    if n and counts.min().item() < 0:
        i = _first_bad(counts < 0)
        raise ValueError(f"{name}.offsets: expected non-decreasing offsets, got "
                         f"{int(off[i])} then {int(off[i + 1])} at position {i}")
    if last != nnz:
        raise ValueError(f"{name}.offsets: expected offsets[N] = nnz = {nnz} (the "
                         f"length of token_ids), got {last}")
    row_of = torch.repeat_interleave(torch.arange(n), counts, output_size=nnz)
    valid_e = None
    if row_valid is not None and nnz and not bool(row_valid.all()):
        valid_e = row_valid.index_select(0, row_of)
    seen = ids if valid_e is None else torch.where(valid_e, ids, 0)  # masked: never read
    if vocab is not None and nnz:
        lo, hi = (int(v) for v in torch.aminmax(seen))
        if lo < 0 or hi >= vocab:
            bad = (ids < 0) | (ids >= vocab)
            a = _first_bad(bad if valid_e is None else bad & valid_e)
            raise ValueError(f"{name}.token_ids: ids must lie in [0, {vocab}) on valid "
                             f"positions; got {int(ids[a])} at entry {a} (position "
                             f"{int(row_of[a])})")
    if distinct and nnz > 1:
        if vocab is None:  # (the ids' range is checked later: negative ids clamped)
            seen = seen.clamp(min=0)
            span = int(seen.max()) + 1
        else:
            span = vocab
        key = torch.add(seen, row_of, alpha=span)
        if valid_e is not None:  # a masked position's entries: distinct negative keys
            key = torch.where(valid_e, key, -1 - torch.arange(nnz))
        if n * span < 2 ** 31 and nnz < 2 ** 31:
            key = key.int()  # half the radix sort's passes
        s = key.sort().values
        dup = s[1:] == s[:-1]
        if bool(dup.any()):  # (a masked entry's key is unique: never a duplicate)
            k = int(s[1:][dup][0])
            raise ValueError(f"{name}.token_ids: ids must be distinct within a position; "
                             f"id {k % span} appears twice at position {k // span}")
    return _Csr(ids, off, row_of, valid_e, counts)


def _csr_on_device(name, ids, off, counts, n, vocab, row_valid, distinct):
    """check_csr on a device (or under torch.compile): asynchronous device assertions, no
    host read; bad ids replaced by 0."""
    nnz = ids.numel()
    torch._assert_async((off[0] == 0) & (off[-1] == nnz) & (counts >= 0).all(),
                        f"{name}.offsets: expected 0 first, non-decreasing, nnz last")
    counts = counts.clamp(min=0)
    row_of = torch.repeat_interleave(torch.arange(n, device=off.device), counts,
                                     output_size=nnz)
    valid_e = None if row_valid is None else row_valid[row_of]
    check = torch.ones_like(ids, dtype=torch.bool) if valid_e is None else valid_e
    if vocab is not None:
        bad = check & ((ids < 0) | (ids >= vocab))
        torch._assert_async(~bad.any(), f"{name}.token_ids: ids must lie in [0, {vocab})")
        ids = torch.where(bad, 0, ids)
    if distinct and nnz > 1:
        span = vocab if vocab is not None else 2 ** 31
        key = torch.where(check, row_of * span + ids.clamp(min=0),
                          -1 - torch.arange(nnz, device=ids.device))
        s = key.sort().values
        dup = (s[1:] == s[:-1]) & (s[1:] >= 0)
        torch._assert_async(~dup.any(), f"{name}.token_ids: ids must be distinct within "
                                        "a position")
    return _Csr(ids, off, row_of, valid_e, counts)


def check_teacher_logprobs(name, logprobs, ids, row_of, n, row_valid, acc, csr=None):
    """The teacher's log-probs [nnz]: finite or -inf, <= 0, and each valid position's
    mass sum exp <= 1 + MASS_TOLERANCE. Returns them in acc (masked positions' entries -inf,
    never read), and the per-position mass PT [n]. csr: check_csr's _Csr of the same call
    (its valid_e and counts are reused), or None."""
    ck.tensor(name, logprobs, floating=True)
    ck.same_device(name, logprobs, "logits", ids)
    if logprobs.dim() != 1 or logprobs.numel() != ids.numel():
        raise ValueError(f"{name}: expected [nnz] = [{ids.numel()}] (one per token_id), got "
                         f"shape {list(logprobs.shape)}")
    lt = logprobs.detach().to(acc)
    if not ck.host_readable(lt):
        return _logprobs_on_device(name, lt, row_of, n, row_valid, acc)
    with _one_thread():
        return _logprobs_on_host(name, logprobs, lt, row_of, n, row_valid, acc, csr)


def _logprobs_on_host(name, logprobs, lt, row_of, n, row_valid, acc, csr):
    """check_teacher_logprobs on CPU tensors: lt <= 0 as one pass (NaN fails it too), the
    mass as exp and one sum; the message's details only on the way to raising."""
    nnz = lt.numel()
    if csr is not None:
        valid_e, counts = csr.valid_e, csr.counts
    else:
        valid_e = None if bool(row_valid.all()) else row_valid.index_select(0, row_of)
        counts = None
    if valid_e is not None:  # masked positions' entries: -inf, never read nor checked
        lt = torch.where(valid_e, lt, float("-inf"))
    if nnz and not bool((lt <= 0).all()):  # (False for NaN too)
        bad_nan = torch.isnan(lt)
        if bool(bad_nan.any()):
            raise ValueError(f"{name}: NaN at entry {_first_bad(bad_nan)} (a valid position)")
        a = _first_bad(lt > 0)
        raise ValueError(f"{name}: log-probabilities must be <= 0; got "
                         f"{float(logprobs[a])} at entry {a}")
    e = lt.exp()
    k = nnz // n if n else 0
    if counts is not None and n and k * n == nnz and bool((counts == k).all()):
        mass = e.view(n, k).sum(1)  # every position holds k entries (a top-k teacher)
    else:
        mass = torch.zeros(n, dtype=acc).index_add_(0, row_of, e)
    bad_mass = mass > 1.0 + MASS_TOLERANCE  # (a masked position's mass is 0)
    if bool(bad_mass.any()):
        i = _first_bad(bad_mass)
        raise ValueError(f"{name}: the teacher's mass on a set must be <= 1 (+ "
                         f"{MASS_TOLERANCE}); got {float(mass[i]):.6g} at position {i}")
    return lt.contiguous(), mass


def _logprobs_on_device(name, lt, row_of, n, row_valid, acc):
    valid = row_valid[row_of]
    bad_nan = valid & torch.isnan(lt)
    bad_pos = valid & (lt > 0)
    lt = torch.where(valid & ~torch.isnan(lt), lt.clamp(max=0.0), float("-inf")).contiguous()
    mass = torch.zeros(n, dtype=acc, device=lt.device).index_add_(0, row_of, lt.exp())
    bad_mass = row_valid & (mass > 1.0 + MASS_TOLERANCE)
    torch._assert_async(~(bad_nan.any() | bad_pos.any() | bad_mass.any()),
                        f"{name}: expected log-probabilities <= 0, not NaN, with a mass "
                        f"<= 1 per position")
    return lt, mass


# ------------------------------------------------------------------ the eager composite

def distill_terms_torch(z2, ids, row_of, lt, row_valid, tail):
    """The eager composite (backend="torch"): per-position (kl, student_mass, teacher_tail)
    [n] from z2 = logits / temperature [n, V] (differentiable through autograd), on the
    checked CSR; 0 on invalid positions. Materialises [n, V] (log_softmax, the set mask)."""
    n, v = z2.shape
    logp = torch.log_softmax(z2, dim=-1)
    ids_r = torch.where(row_valid[row_of], ids, 0)
    lps = logp[row_of, ids_r]
    pt = lt.exp()
    on = pt > 0
    zero_n = torch.zeros(n, dtype=z2.dtype, device=z2.device)
    kl = zero_n.index_add(0, row_of, torch.where(on, pt * (lt.where(on, 0.0) - lps.where(
        on, 0.0)), 0.0))
    pt_sum = zero_n.index_add(0, row_of, pt)
    ps_sum = zero_n.index_add(0, row_of, lps.exp())
    counts = torch.zeros(n, dtype=torch.long, device=z2.device).index_add_(
        0, row_of, torch.ones_like(row_of))
    whole = counts == v
    tail_t = torch.where(whole, 0.0, (1.0 - pt_sum).clamp(min=0.0))
    if tail:
        in_s = torch.zeros(n, v, dtype=torch.bool, device=z2.device)
        in_s[row_of, ids_r] = True
        # log(1 - PS) as a log-sum-exp of the complement, relative to the row's (the same
        # call: an empty set gives exactly 0)
        log_comp = (torch.logsumexp(z2.masked_fill(in_s, float("-inf")), dim=-1) -
                    torch.logsumexp(z2, dim=-1))
        has = tail_t > 0
        term = tail_t * (torch.log1p(-pt_sum.where(has, 0.0)) - log_comp.where(has, 0.0))
        kl = kl + torch.where(has, term, 0.0)
    kl = torch.where(row_valid, kl, 0.0)
    return kl, torch.where(row_valid, ps_sum, 0.0).detach(), torch.where(row_valid, tail_t,
                                                                         0.0)


# ------------------------------------------------------------------ the call

class _Call(NamedTuple):
    """The checked tensors of one call: logits3 [B, Tl, V], mask [B, T] (the kernels'
    layout), the CSR, the weights (None for "none"), the padded mask and packing."""

    logits3: Any
    mask: Any
    ids: Any
    offsets: Any
    row_of: Any
    lt: Any
    weights: Any
    acc: Any
    be: Any
    flat: bool
    packing: Any
    padded_mask: Any


def _grad_scale(value, dtype, acc):
    g = ck.positive_in("grad_scale", value, acc)
    return min(g, 1.0) if dtype == torch.float16 else g


def _positions(shape, n, name):
    """(B, T) of the positions of a [B, Tl, ...] input against the teacher's N: Tl (aligned)
    or Tl - 1 (the model's raw output, the last position ignored)."""
    b, tl = shape[0], shape[1]
    if b * tl == n:
        return b, tl
    if tl > 0 and b * (tl - 1) == n:
        return b, tl - 1
    raise ValueError(f"teacher.offsets: N + 1 = {n + 1} entries do not fit {name} of shape "
                     f"{list(shape)} (expected N = B * T = {b * tl}, or {b * (tl - 1)} for "
                     f"the raw [B, T + 1, ...] output)")


def check_call(like, vocab, teacher, response_mask, options, name="logits", sharded=False):
    """Every check of a distill_loss call but the logits' own (like: the logits [B, Tl, V]
    or the hidden states [B, Tl, H], 3-D): (_Call without logits3, tail, temperature,
    grad_scale). sharded: like is this rank's vocabulary shard (ppo_kernels/distill_tp.py;
    vocab None: the ids' range is checked after the statistics all-gather)."""
    if not isinstance(teacher, (SparseLogprobs, tuple)) or len(teacher) != 3:
        raise TypeError(f"teacher: expected a SparseLogprobs(token_ids, offsets, logprobs), got "
                        f"{type(teacher).__name__}")
    teacher = SparseLogprobs(*teacher)
    ck.tensor("teacher.offsets", teacher.offsets, integer=True)
    if teacher.offsets.dim() != 1 or teacher.offsets.numel() < 1:
        raise ValueError(f"teacher.offsets: expected int64 [N + 1], got shape "
                         f"{list(teacher.offsets.shape)}")
    n = teacher.offsets.numel() - 1
    acc = ck.acc_dtype(like)
    flat = options["flat"]
    if flat and like.shape[1] != n:
        raise ValueError(f"teacher.offsets: N + 1 = {n + 1} entries do not fit {name} of shape "
                         f"{list(like.shape[1:])} (expected N = {like.shape[1]} positions)")
    b, t = _positions(like.shape, n, name)
    shape_like = torch.empty((b, t), dtype=torch.bool, device=like.device)
    packing = None
    if options.get("cu_seqlens") is not None:
        if b != 1:
            raise ValueError(f"{name}: with cu_seqlens expected the packed layout [1, total, "
                             f"...] or [total, ...], got {list(like.shape)}")
        packing = packed.packing(options["cu_seqlens"], t, shape_like, options.get("max_seqlen"))
    else:
        packed.check_max_seqlen(options.get("max_seqlen"))
    mask = ck.response_mask(response_mask, shape_like, flat, like_name=name)
    tail = ck.flag("tail", options["tail"])
    temperature = ck.temperature(options["temperature"], like)
    mode = ck.choice("loss_agg_mode", options["loss_agg_mode"], LOSS_AGG_MODES)
    gs = _grad_scale(options["grad_scale"], like.dtype, acc)
    if not sharded and (options.get("tp_group") is not None or
                        options.get("vocab_start") is not None):
        raise NotImplementedError("tp_group / vocab_start: distill_loss does not run over a "
                                  "vocabulary split across ranks yet; gather the logits (or "
                                  "the LM head) on one rank, or use the unsplit vocabulary")
    if not sharded and hasattr(like, "to_local"):
        raise NotImplementedError(f"{name}: a DTensor (a vocabulary split over ranks) is not "
                                  f"supported by distill_loss yet")
    row_valid = mask.reshape(n)
    csr = _check_csr("teacher", teacher.token_ids, teacher.offsets, n, like, vocab,
                     row_valid, True)
    ids, off, row_of = csr.ids, csr.off, csr.row_of
    lt, _ = check_teacher_logprobs("teacher.logprobs", teacher.logprobs, ids, row_of, n,
                                   row_valid, acc, csr=csr)
    gnt, gns = options.get("global_num_tokens"), options.get("global_num_seqs")
    if gnt is not None:
        gnt = ck.count("global_num_tokens", gnt, like, acc)
    if gns is not None:
        gns = ck.count("global_num_seqs", gns, like, acc)
    norm_length = options.get("norm_length")
    if norm_length is not None:
        norm_length = ck.positive_in("norm_length", norm_length, acc)
    padded_mask = mask if packing is None else packing.pad(mask, fill=False)
    weights = None
    if mode != "none":
        if packing is not None and norm_length is None:
            norm_length = packing.lens.max().clamp(min=1).to(acc) if packing.num_seqs else 1.0
        w = agg_weights(padded_mask, mode, gnt, norm_length, dtype=acc, global_num_seqs=gns)
        weights = (w if packing is None else packing.unpad(w)).contiguous()
    be = get_backend(options["backend"], like.device)
    if be.is_kernel:
        register_distill(be.prefix)
    call = _Call(None, mask, ids, off, row_of, lt, weights, acc, be, flat, packing,
                 padded_mask)
    return call, tail, temperature, gs


def logits_of(logits):
    ck.tensor("logits", logits, floating=True)
    if logits.dtype not in ck.LOGITS_DTYPES:
        raise TypeError(f"logits: expected float32, bfloat16, float16 or float64, got "
                        f"{logits.dtype}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits: expected [B, T, V], [B, T + 1, V] or [N, V], got shape "
                         f"{list(logits.shape)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits: empty vocabulary (V = 0)")
    flat = logits.dim() == 2
    x = logits.unsqueeze(0) if flat else logits
    if x.stride(2) != 1 and x.shape[2] > 1:
        x = x.contiguous()
    return x, flat


class _PerTokenKernel(torch.autograd.Function):
    """loss_agg_mode="none" on the kernel backends: the per-token kl with the unweighted
    gradient written in the forward; the backward multiplies each row by its grad_output
    (one pass, a fresh buffer)."""

    @staticmethod
    def forward(ctx, logits3, op, mask, off, ids, lt, ones, temperature, tail):
        need = logits3.requires_grad
        _, kl, ps, tt, dl = op(logits3, mask, off, ids, lt, ones, temperature, 1.0, tail, need)
        ctx.save_for_backward(dl if need else None)
        ctx.t = mask.shape[1]
        ctx.mark_non_differentiable(ps, tt)
        return kl, ps, tt

    @staticmethod
    def backward(ctx, g_kl, *_):
        (dl,) = ctx.saved_tensors
        if dl is None or g_kl is None:
            return (None,) * 9
        gfull = torch.zeros(dl.shape[:2], dtype=g_kl.dtype, device=g_kl.device)
        gfull[:, :ctx.t] = g_kl
        return (dl * gfull[..., None].to(dl.dtype),) + (None,) * 8


def kernel_terms(c, logits3, tail, temperature, gs):
    """(loss or None, kl, student_mass, teacher_tail), per-token [B, T], on a kernel
    backend."""
    op = c.be.op("distill_fwd")
    if c.weights is None:
        kl, ps, tt = _PerTokenKernel.apply(logits3, op, c.mask, c.offsets, c.ids, c.lt,
                                           c.mask.to(c.acc), temperature, tail)
        return None, kl, ps, tt
    need = wants_grad(logits3)
    loss, kl, ps, tt, _ = op(logits3, c.mask, c.offsets, c.ids, c.lt, c.weights, temperature,
                             gs, tail, need)
    return loss, kl.detach(), ps.detach(), tt.detach()


def torch_terms(c, logits3, tail, temperature):
    b, t = c.mask.shape
    z2 = logits3[:, :t].to(c.acc).reshape(b * t, -1) / temperature
    kl, ps, tt = distill_terms_torch(z2, c.ids, c.row_of, c.lt, c.mask.reshape(-1), tail)
    kl, ps, tt = (x.view(b, t) for x in (kl, ps, tt))
    loss = None if c.weights is None else (c.weights * kl).sum()
    return loss, (kl if c.weights is None else kl.detach()), ps, tt.detach()


def metrics_of(c, kl, ps, tt):
    """The metrics dict from the per-token terms (kernel layout): means over valid tokens
    (0 if none) of kl, student_mass, teacher_tail_mass; num_tokens, num_seqs."""
    with torch.no_grad():
        m = c.mask
        n = m.sum()
        d = n.clamp(min=1).to(c.acc)
        out = {"kl": (torch.where(m, kl.detach(), 0.0).sum() / d).float(),
               "student_mass": (torch.where(m, ps, 0.0).sum() / d).float(),
               "teacher_tail_mass": (torch.where(m, tt, 0.0).sum() / d).float(),
               "num_tokens": n.float(),
               "num_seqs": c.padded_mask.any(dim=1).sum().float()}
    return out


def finish_loss(c, loss, kl):
    if c.weights is not None:
        return loss
    per = torch.where(c.mask, kl, 0.0)
    return per[0] if c.flat else per



def placeholder_tokens(hidden, teacher):
    """Checks hidden's rank and the teacher's N against it; zero tokens of the positions'
    shape ([N] for [N, H] hidden, else [B, T]) for from_hidden's shape checks."""
    if not isinstance(teacher, (SparseLogprobs, tuple)) or len(teacher) != 3:
        raise TypeError(f"teacher: expected a SparseLogprobs(token_ids, offsets, logprobs), got "
                        f"{type(teacher).__name__}")
    ck.tensor("hidden", hidden)
    ck.tensor("teacher.offsets", teacher[1], integer=True)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden: expected [B, T, H], [B, T + 1, H] or [N, H], got shape "
                         f"{list(hidden.shape)}")
    n = teacher[1].numel() - 1
    flat = hidden.dim() == 2
    if flat:
        tokens = torch.zeros(n, dtype=torch.long, device=hidden.device)
    else:
        b, tl = hidden.shape[0], hidden.shape[1]
        t = tl if b * tl == n else tl - 1
        if b * t != n:
            raise ValueError(f"teacher.offsets: N + 1 = {n + 1} entries do not fit hidden of "
                             f"shape {list(hidden.shape)} (expected N = B * T = {b * tl}, or "
                             f"{b * (tl - 1)} for the raw [B, T + 1, H] output)")
        tokens = torch.zeros(b, t, dtype=torch.long, device=hidden.device)
    return tokens


__all__ = ["SparseLogprobs", "check_csr", "check_teacher_logprobs",
           "MASS_TOLERANCE"]
