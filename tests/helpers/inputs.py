"""The tests' random inputs: each draws from its own seeded torch.Generator (or numpy
Generator), so a test's inputs are the same in every run. The golden table
(tests/test_golden.py) and the seeded tests depend on these exact draws: a change here
changes what they check.

make_mask and one_token_rows are ppo_kernels.testing's (the public testing API: users draw
the same paddings). make_inputs keeps its own draw order, which the seeded tests were tuned
on (ppo_kernels.testing.make_batch draws differently)."""

import numpy as np
import torch

import ppo_kernels as pk
from ppo_kernels import reference as ref
from ppo_kernels.testing import make_mask

from helpers.backends import CPU, TRITON_DEVICE

PADDINGS = ("left", "right", "interior", "none", "random", "empty_row", "all")


def make_inputs(B, T, V, gen, *, dtype=torch.float32, padding="mixed", scale=2.0,
                ratio_spread=0.35, neginf=False, layout="aligned"):
    """Fresh random inputs of ppo_loss / token_logprobs, on the CPU.

    old_logprobs = logp + noise (so the ratios spread over both sides of the clip band),
    ref_logprobs likewise; advantages of both signs; rollout_is_weights in [0.5, 1.5];
    garbage token ids on masked positions (they must never be read).
    layout: "aligned" contiguous [B, T, V]; "view" logits[:, :-1] of a [B, T + 1, V]
    tensor; "raw" the [B, T + 1, V] tensor; "tbatch" a [B, T, V] view whose batch is the
    transposed leading dimension of a [T, B, V] tensor.
    Returns a dict (CPU tensors); logits_for(inp, backend) makes the logits on a device;
    "base" is the float64 copy of those logits (after rounding to dtype) that the
    reference sees.
    """
    full = torch.randn(B, T + 1, V, generator=gen, dtype=torch.float64) * scale
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = make_mask(B, T, gen, padding)
    if neginf and V > 1:
        ban = torch.rand(B, T + 1, V, generator=gen) < 0.3
        ban[:, :T].scatter_(2, tokens[..., None], False)
        full[ban] = float("-inf")
        # one row with a single finite entry: p = 1, H = 0
        full[0, 0] = float("-inf")
        full[0, 0, tokens[0, 0]] = 0.5
    full = full.to(dtype)  # the rounded logits are what everyone sees
    fd = full.double()
    logp, _ = ref.token_logprobs(fd, tokens, None)
    logp = torch.from_numpy(logp)
    old = logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * ratio_spread
    reflp = logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * ratio_spread
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    isw = 0.5 + torch.rand(B, T, generator=gen, dtype=torch.float64)
    garbage = torch.tensor([-1, V, V + 1000, -7])
    bad = garbage[torch.randint(0, 4, (B, T), generator=gen)]
    tokens = torch.where(mask, tokens, bad)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    inp = dict(full=full, layout=layout, tokens=tokens, mask=mask, old=old.to(acc),
               adv=adv.to(acc), ref=reflp.to(acc), isw=isw.to(acc))
    _, logits = logits_for(inp, CPU, requires_grad=False)
    inp["base"] = logits.double()  # what the reference sees (aligned with the layout)
    return inp


def seeded_inputs(B, T, V, seed, **kw):
    """make_inputs with a generator seeded by ``seed``."""
    return make_inputs(B, T, V, torch.Generator().manual_seed(seed), **kw)


def small_inputs(B=2, T=3, V=5, seed=0):
    """A tiny batch of the public API's inputs (no mask): logits [B, T, V] (randn * 2),
    tokens, old and ref logprobs in [-2, -1), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    return dict(logits=torch.randn(B, T, V, generator=g) * 2,
                tokens=torch.randint(0, V, (B, T), generator=g),
                old=-torch.rand(B, T, generator=g) - 1,
                adv=torch.randn(B, T, generator=g),
                ref=-torch.rand(B, T, generator=g) - 1)


# a mask of small_inputs' default [2, 3]: a padded position in each row
SMALL_MASK = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)


def logits_for(inp, be, requires_grad=True):
    """(leaf, logits) on be's device in inp's layout; logits is a view of leaf (or leaf).
    With requires_grad the view keeps its own .grad (retain_grad)."""
    full = inp["full"].to(be.device).detach().clone()
    T = inp["tokens"].shape[1]
    layout = inp["layout"]
    if layout == "aligned":
        leaf = full[:, :T].contiguous()
        view = lambda x: x  # noqa: E731
    elif layout == "view":
        leaf = full
        view = lambda x: x[:, :T]  # noqa: E731
    elif layout == "raw":
        leaf = full
        view = lambda x: x  # noqa: E731
    elif layout == "tbatch":
        leaf = full[:, :T].transpose(0, 1).contiguous()
        view = lambda x: x.transpose(0, 1)  # noqa: E731
    else:
        raise AssertionError(layout)
    leaf.requires_grad_(requires_grad)
    logits = view(leaf)
    if requires_grad and logits is not leaf:
        logits.retain_grad()
    return leaf, logits


# ------------------------------------------------------------------ the raw ops' inputs

def acc_of(dtype):
    """The accumulation dtype of logits of ``dtype`` (float64 for float64, else float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def make_case(B=2, T=5, V=7, dtype=torch.float32, layout="aligned", padding="random",
              neginf=False, seed=0, scale=2.0):
    """logits (in the given layout), tokens (garbage ids on masked positions), mask.

    layout: "aligned" [B, T, V] contiguous; "view" logits[:, :-1] of a [B, T+1, V] tensor
    (strided, Tl = T); "raw" the [B, T+1, V] tensor itself (Tl = T + 1);
    "bstride": a [B, T, V] view with a padded batch stride.
    neginf: about a fifth of the entries -inf (never the sampled token), and one row with
    a single finite entry (p = 1 there, H = 0).
    """
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(B, T + 1, V, generator=gen) * scale
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = make_mask(B, T, gen, padding)
    if neginf:
        ban = torch.rand(B, T + 1, V, generator=gen) < 0.2
        ban[:, :T].scatter_(2, tokens[..., None], False)
        base[ban] = float("-inf")
        base[0, 0] = float("-inf")
        base[0, 0, tokens[0, 0]] = 0.5
    tokens = torch.where(mask, tokens, torch.full_like(tokens, V + 1000))  # never read
    base = base.to(dtype)
    if layout == "aligned":
        logits = base[:, :T].contiguous()
    elif layout == "view":
        logits = base[:, :T]
    elif layout == "raw":
        logits = base
    elif layout == "bstride":
        logits = torch.cat([base, base], dim=1)[:, :T]
    else:
        raise AssertionError(layout)
    return logits.to(TRITON_DEVICE), tokens.to(TRITON_DEVICE), mask.to(TRITON_DEVICE)


def per_token(x, acc):
    """A per-token input (numpy or tensor) as a contiguous ``acc`` tensor on the device."""
    return torch.as_tensor(np.asarray(x), dtype=acc).to(TRITON_DEVICE).contiguous()


def rand_tok(B, T, acc, seed, scale=1.0):
    """A seeded randn [B, T] of ``acc`` on the device (upstream gradients, values)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=gen, dtype=torch.float64) * scale
    return x.to(acc).to(TRITON_DEVICE)


def ppo_inputs(logits, tokens, mask, seed, mode="token-mean", with_ref=True,
               with_isw=False):
    """The per-token inputs of the ppo_loss ops for a make_case batch, as float64 numpy
    arrays rounded to the accumulation dtype: old, adv, ref, isw (or None) and the
    aggregation weights w of ``mode``; "acc" the accumulation dtype."""
    B, T = tokens.shape
    acc = acc_of(logits.dtype)
    rl, _ = ref.token_logprobs(logits, tokens, mask)
    m = mask.cpu().numpy()
    gen = np.random.default_rng(seed)
    # old logprobs near the current ones (ratios both inside and outside the clip band),
    # advantages of both signs; on chosen valid tokens: one log-ratio past the clamp, one
    # ratio e^1.5 = 4.5 with A < 0 (the dual clip's cap, c = 2 or 3, is the active value
    # there, with no clamp to hide its zero gradient)
    old = (rl + gen.normal(0, 0.3, rl.shape)) * m
    adv = gen.normal(0, 1.0, rl.shape)
    valid = np.argwhere(m)
    if len(valid) >= 2:
        (b0, t0), (b1, t1) = valid[0], valid[-1]
        old[b0, t0] = rl[b0, t0] - 25.0
        old[b1, t1] = rl[b1, t1] - 1.5
        adv[b1, t1] = -abs(adv[b1, t1]) - 0.5
    refl = (rl + gen.normal(0, 0.4, rl.shape)) * m if with_ref else None
    isw = gen.uniform(0.5, 1.5, rl.shape) if with_isw else None
    w = ref.agg_weights(m, mode)
    # rounded to the accumulation dtype: the oracle sees the numbers the kernel reads
    r = {k: None if x is None else torch.as_tensor(x).to(acc).double().numpy()
         for k, x in dict(old=old, adv=adv, ref=refl, isw=isw, w=w).items()}
    return dict(r, acc=acc)


def k3_deltas(n, seed):
    """float32 deltas log-uniform in [1e-6, 20], both signs, plus the edges."""
    gen = np.random.default_rng(seed)
    mag = np.exp(gen.uniform(np.log(1e-6), np.log(20.0), n))
    edges = np.array([1e-6, 1e-4, 0.5, 1.0 - 2**-24, 1.0, 1.0 + 2**-23, 2.0, 20.0])
    d = np.concatenate([mag, edges])
    return np.concatenate([d, -d]).astype(np.float32)


# ------------------------------------------------------------------ a small packed batch
# The packed, tensor- and context-parallel argument tests share a small packed batch:
# sequences of lengths 3, 0 and 2 packed into total = 5 rows (cu_seqlens [0, 3, 3, 5]),
# a vocabulary of 11 and hidden states of 6.

PK_V, PK_H = 11, 6
PK_LENS = [3, 0, 2]
PK_TOTAL, PK_S = sum(PK_LENS), len(PK_LENS)
PK_CU = torch.tensor([0, 3, 3, 5], dtype=torch.int32)


def packed_batch(seed=0, total=PK_TOTAL):
    """The small packed batch's tensors (per token: [total]; per sequence: [S])."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        logits=torch.randn(total, PK_V, generator=g),
        tokens=torch.randint(0, PK_V, (total,), generator=g),
        old=torch.randn(total, generator=g) * 0.3 - 2.0,
        adv=torch.randn(total, generator=g),
        mask=torch.rand(total, generator=g) > 0.2,
        values=torch.randn(total, generator=g),
        hidden=torch.randn(total, PK_H, generator=g),
        weight=torch.randn(PK_V, PK_H, generator=g),
        scores=torch.randn(PK_S, generator=g),
    )


# ------------------------------------------------------------------ kept sets (sampling replay)

def random_csr(B, T, V, gen, *, kmax=6, tokens=None, drop_token_frac=0.0, empty_frac=0.0,
               lacks_token=None):
    """A random SamplingMask over B * T rows and the dense bool [B, T, V] it encodes.

    Per row: a set of 1..kmax random ids. With ``tokens``, the sampled token is put in its
    row's set (last) unless the row drops it. ``lacks_token`` None: each row draws whether it
    is empty (``empty_frac``) and whether it drops its token (``drop_token_frac``);
    otherwise a function of the row index says which rows lack their token, no row is
    empty and neither is drawn (the rank scripts' sets: every third lacks its token)."""
    ids, offs, dense = [], [0], torch.zeros(B * T, V, dtype=torch.bool)
    for i in range(B * T):
        if lacks_token is None and torch.rand((), generator=gen) < empty_frac:
            offs.append(offs[-1])
            continue
        k = int(torch.randint(1, min(kmax, V) + 1, (), generator=gen))
        row = torch.randperm(V, generator=gen)[:k]
        if tokens is not None:
            y = int(tokens.reshape(-1)[i])
            drop = lacks_token(i) if lacks_token is not None else \
                torch.rand((), generator=gen) < drop_token_frac
            row = row[row != y]
            if not drop:
                row = torch.cat([row, torch.tensor([y])])
        ids.append(row)
        offs.append(offs[-1] + len(row))
        dense[i, row] = True
    ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    return pk.SamplingMask(ids, torch.tensor(offs)), dense.view(B, T, V)


# ------------------------------------------------------------------ teachers (distillation)

def make_teacher(n, v, gen, sizes=None, dtype=torch.float32, full_mass=False, tscale=2.0):
    """A random teacher CSR over n positions: set sizes (default random in [0, v]), each
    set the teacher's top-|S| of a random softmax (full_mass: renormalised on the set)."""
    ids, lps, off = [], [], [0]
    for i in range(n):
        k = int(torch.randint(0, v + 1, (1,), generator=gen)) if sizes is None else sizes[i]
        lp_full = torch.log_softmax(torch.randn(v, generator=gen, dtype=torch.float64) * tscale,
                                    0)
        top = torch.argsort(lp_full, descending=True)[:k]
        perm = top[torch.randperm(k, generator=gen)]
        lp = lp_full[perm]
        if full_mass and k:
            lp = lp - torch.logsumexp(lp, 0)
        ids.append(perm)
        lps.append(lp)
        off.append(off[-1] + k)
    return pk.SparseLogprobs(torch.cat(ids).long() if ids else torch.zeros(0, dtype=torch.long),
                             torch.tensor(off, dtype=torch.long),
                             torch.cat(lps).to(dtype) if lps else torch.zeros(0, dtype=dtype))


def teacher_of(b, t, v, g, dtype):
    """A teacher's sets over b * t positions: variable sizes (empty, 1, 3, 5, the whole
    vocabulary), log-probs of a teacher softmax (mass <= 1), one confident position."""
    tl = torch.log_softmax(torch.randn(b * t, v, generator=g, dtype=torch.float64) * 2, -1)
    tl[1] = torch.log_softmax(torch.tensor([30.0] + [0.0] * (v - 1), dtype=torch.float64), -1)
    ids, lps, off = [], [], [0]
    sizes = [0, 1, 3, 5, v]
    for i in range(b * t):
        k = sizes[i % len(sizes)] if i != 1 else 2
        sel = torch.randperm(v, generator=g)[:k] if i != 1 else torch.tensor([0, 7])
        ids.append(sel)
        lps.append(tl[i, sel])
        off.append(off[-1] + k)
    return pk.SparseLogprobs(torch.cat(ids), torch.tensor(off), torch.cat(lps).to(dtype))


# ------------------------------------------------------------------ the LM head's inputs

def head_inputs(B=3, T=5, H=6, V=13, *, dtype=torch.float32, seed=0, extra_pos=False,
                bias=False, scale=0.7):
    """The from-hidden ops' inputs (test_from_hidden.py): hidden [B, T (+ 1 with
    extra_pos), H], the head W [V, H] (and a bias), tokens, a mask with left padding and
    an empty row, and old / ref / rollout log-probs near the current ones (float32). The
    float tensors of the head's side require grad."""
    g = torch.Generator().manual_seed(seed)
    Tl = T + 1 if extra_pos else T
    hidden = torch.randn(B, Tl, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64) * scale
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.3 if bias else None
    tokens = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0, :2] = False  # left padding
    if B > 2:
        mask[2] = False  # an empty row
        mask[1] = True
    with torch.no_grad():
        logits = torch.nn.functional.linear(hidden[:, :T], W, b)
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    old = (lp + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    refl = (lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    roll = (old + 0.1 * torch.randn(B, T, generator=g)).float()
    adv = torch.randn(B, T, generator=g)
    hidden = hidden.to(dtype).requires_grad_()
    W = W.to(dtype).requires_grad_()
    if b is not None:
        b = b.to(dtype).requires_grad_()
    return dict(hidden=hidden, W=W, b=b, tokens=tokens, mask=mask, old=old, ref=refl,
                roll=roll, adv=adv)


def head_logits(hidden, W, b=None, cap=None):
    """The logits the head makes (a soft cap: cap * tanh(x / cap))."""
    x = torch.nn.functional.linear(hidden, W, b)
    return x if cap is None else cap * torch.tanh(x / cap)
