"""Tests of ppo_kernels/packed.py: packed sequences (cu_seqlens, verl's / OpenRLHF's
remove-padding layout) against the padded [S, max_seqlen] layout of the same sequences:
every op that takes cu_seqlens (ppo_loss, ppo_loss_from_hidden, score_rollout, gae,
kl_penalized_rewards, whiten), every policy loss and aggregation mode, the rollout
corrections, per-sequence inputs, the [total, V], [1, total, V] and [1, total + 1, V]
layouts, backends cpu, torch and triton (the interpreter, small shapes), float32 tight,
bfloat16 loose, float64 gradcheck. Bad cu_seqlens / max_seqlen and per-token inputs of a
wrong length: a ValueError or TypeError naming the argument, on every op.

The padded twin of a packed batch: sequence s is row s of [S, L] (L = the longest
sequence), the padding masked out; per-token inputs hold NaN on the masked positions
inside the sequences (both layouts), token ids out of range there. The packed result must
be the padded one read at the packed positions: loss (per token for "none"), every metric,
the gradient of every packed row of logits.
"""

import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ppo_kernels as pk
from ppo_kernels import reference as R

from helpers.asserts import raises_naming
from helpers.backends import TRITON_INTERP, backend_params
from helpers.inputs import PK_CU, PK_H, PK_S, PK_TOTAL, PK_V, packed_batch

EXAMPLES = int(os.environ.get("PPO_HYPOTHESIS_EXAMPLES", 60))
# derandomize comes from the conftest hypothesis profile ("ci" derandomized, the default;
# HYPOTHESIS_PROFILE=random draws fresh examples: docs/TESTING.md)
SETTINGS = settings(max_examples=max(4, EXAMPLES // 2), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

POLICIES = ["vanilla", "cispo", "sapo", "gspo", "gspo-token", "dppo-tv", "dppo-kl"]
AGG = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
       "seq-mean-token-sum-norm", "none"]
RC = ["tis", "tis-seq", "mis", "mis-seq", "geo-seq"]
BACKENDS = backend_params(cuda=False)  # cpu, torch, triton (interpreter)
BACKENDS_FAST = backend_params(interp=False, cuda=False)
TRITON = [p for p in BACKENDS if p.values[0] is TRITON_INTERP]  # (keeps its skipif mark)

# ragged batches that matter: empty sequences, length 1, a single sequence, lengths that
# are multiples of nothing
EDGE_LENS = {
    "mixed": [3, 0, 1, 5, 0, 2],
    "single": [7],
    "s1-len1": [1],
    "all-len1": [1, 1, 1],
    "empty-ends": [0, 4, 3, 0],
    "one-nonempty": [0, 0, 5, 0],
}
TRITON_LENS = [2, 0, 1, 4]  # total 7 <= 16 rows for the interpreter

TOL32 = 1e-6  # relative to the largest reference entry
TOL16 = 1e-2


# ------------------------------------------------------------------ batches


class Batch:
    """A random ragged batch in both layouts. ``p``: the packed tensors ([total] per token,
    [total, V] logits); ``pad(x)``: x [total, ...] as [S, L, ...]."""

    def __init__(self, lens, V, seed, *, dtype=torch.float32, p_mask=0.25, confident=0.25,
                 scale=2.0, nan=True, H=None):
        g = torch.Generator().manual_seed(seed)
        self.lens, self.V, self.dtype = list(lens), V, dtype
        self.S, self.total = len(lens), int(sum(lens))
        self.L = max(lens, default=0)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        self.cu = torch.tensor(cu, dtype=torch.int32)
        self.seq_id = torch.tensor([s for s, n in enumerate(lens) for _ in range(n)],
                                   dtype=torch.long)
        self.pos = torch.tensor([i for n in lens for i in range(n)], dtype=torch.long)
        n = self.total
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        if H is None:
            logits = torch.randn(n, V, generator=g, dtype=torch.float64) * scale
        else:  # from hidden states: the logits are hidden @ W^T
            self.hidden = (torch.randn(n, H, generator=g, dtype=torch.float64)).to(dtype)
            self.weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5).to(dtype)
            logits = self.hidden.double() @ self.weight.double().T
        tokens = torch.randint(0, V, (n,), generator=g)
        conf = torch.rand(n, generator=g) < confident
        if H is None and n:
            logits[conf, tokens[conf]] = 30.0  # confident sampled tokens, p ~ 1
        self.logits = logits.to(dtype)
        mask = torch.rand(n, generator=g) >= p_mask
        logp = torch.log_softmax(self.logits.double(), -1).gather(-1, tokens[:, None])[:, 0]
        noise = lambda s: torch.randn(n, generator=g, dtype=torch.float64) * s  # noqa: E731
        old = logp + noise(0.3)
        t = {
            "old": old, "ref": logp + noise(0.3), "rollout": old + noise(0.15),
            "adv": noise(1.0), "isw": 0.5 + torch.rand(n, generator=g, dtype=torch.float64),
            "values": noise(1.0), "rewards": noise(1.0), "x": noise(2.0) + 0.7,
        }
        self.seq = {"adv": torch.randn(self.S, generator=g, dtype=torch.float64).to(acc),
                    "isw": (0.5 + torch.rand(self.S, generator=g, dtype=torch.float64)).to(acc),
                    "scores": torch.randn(self.S, generator=g, dtype=torch.float64).float()}
        garbage = torch.tensor([-1, V, V + 1000, -7])[torch.randint(0, 4, (n,), generator=g)]
        self.tokens = torch.where(mask, tokens, garbage)
        self.mask = mask
        self.p = {}
        for k, v in t.items():
            v = v.to(acc)
            self.p[k] = torch.where(mask, v, float("nan")) if nan else v
        self.w_tok = torch.randn(n, generator=g, dtype=torch.float64).to(acc)  # for "none"

    def pad(self, x, fill=0.0):
        """x [total, ...] -> [S, L, ...], fill off the sequences."""
        out = torch.full((self.S, self.L) + tuple(x.shape[1:]), fill, dtype=x.dtype)
        if self.total:
            out[self.seq_id, self.pos] = x
        return out

    def unpad(self, y):
        """y [S, L, ...] -> [total, ...]: the packed positions."""
        return y[self.seq_id, self.pos]

    @property
    def padded_mask(self):
        return self.pad(self.mask, False)

    @property
    def padded_tokens(self):
        return self.pad(self.tokens, 0)


def shaped(x, layout):
    """A packed [total, ...] tensor in a layout: "flat" [total], "row"/"raw" [1, total]."""
    return x if layout == "flat" else x.unsqueeze(0)


def packed_logits(b, layout, requires_grad=True):
    """(leaf, logits) of the packed batch: [total, V], [1, total, V] or the raw
    [1, total + 1, V] (last position ignored)."""
    if layout == "flat":
        leaf = b.logits.clone()
        logits = leaf
    elif layout == "row":
        leaf = b.logits.clone().unsqueeze(0)
        logits = leaf
    else:  # raw
        extra = torch.randn(1, b.V, dtype=torch.float64).to(b.dtype)
        leaf = torch.cat([b.logits, extra]).unsqueeze(0)
        logits = leaf
    leaf.requires_grad_(requires_grad)
    return leaf, logits


def grad_rows(leaf, layout, total):
    g = leaf.grad
    assert g is not None, "no gradient reached the logits"
    if layout == "flat":
        return g
    if layout == "raw":
        assert torch.all(g[0, total:] == 0), "the ignored last position got a gradient"
    return g[0, :total]


def err(a, b):
    """max |a - b| / max |b| (b all 0: the absolute error)."""
    a, b = a.detach().double(), b.detach().double()
    assert a.shape == b.shape, f"shape {list(a.shape)} vs {list(b.shape)}"
    if a.numel() == 0:
        return 0.0
    assert torch.isfinite(a).all(), f"non-finite values: {a}"
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def assert_same(a, b, tol, what):
    e = err(a, b)
    assert e <= tol, f"{what}: relative error {e:.3g} > {tol}"


# ------------------------------------------------------------------ ppo_loss, both layouts


def loss_inputs(b, *, adv="tok", isw=None, old=True, rc=None, off=None, kl=0.0):
    """(packed kwargs, padded kwargs) of ppo_loss other than logits / tokens / layout."""
    P, Q = {}, {}
    P["old_logprobs"] = b.p["old"] if old else None
    Q["old_logprobs"] = b.pad(b.p["old"]) if old else None
    if adv == "tok":
        P["advantages"], Q["advantages"] = b.p["adv"], b.pad(b.p["adv"])
    elif adv == "seq":
        P["advantages"] = Q["advantages"] = b.seq["adv"]
    else:  # "seq1": [S, 1]
        P["advantages"] = Q["advantages"] = b.seq["adv"][:, None]
    if isw == "tok":
        P["rollout_is_weights"], Q["rollout_is_weights"] = b.p["isw"], b.pad(b.p["isw"])
    elif isw == "seq":
        P["rollout_is_weights"] = Q["rollout_is_weights"] = b.seq["isw"]
    if rc is not None or off is not None:
        P["rollout_logprobs"], Q["rollout_logprobs"] = b.p["rollout"], b.pad(b.p["rollout"])
    if rc is not None:
        P["rollout_correction"] = Q["rollout_correction"] = rc
    if off is not None:
        P["off_policy_mask_threshold"] = Q["off_policy_mask_threshold"] = off
    if kl:
        P["ref_logprobs"], Q["ref_logprobs"] = b.p["ref"], b.pad(b.p["ref"])
        P["kl_coef"] = Q["kl_coef"] = kl
    return P, Q


def run_packed_loss(b, layout, backend, P, opts):
    leaf, logits = packed_logits(b, layout)
    kw = {}
    for k, v in P.items():
        # per-token [total] inputs follow the layout; per-sequence [S] / [S, 1] do not
        if isinstance(v, torch.Tensor) and v.dim() == 1 and \
                not any(v is x for x in b.seq.values()):
            v = shaped(v, layout)
        kw[k] = v
    mask = shaped(b.mask, layout)
    tokens = shaped(b.tokens, layout)
    loss, metrics = pk.ppo_loss(logits, tokens, response_mask=mask, cu_seqlens=b.cu,
                                backend=backend, **kw, **opts)
    if opts.get("loss_agg_mode") == "none":
        expect_shape = (b.total,) if layout == "flat" else (1, b.total)
        assert tuple(loss.shape) == expect_shape, f"loss shape {list(loss.shape)}"
        loss_tok = loss.reshape(b.total)
        assert torch.all(loss_tok[~b.mask] == 0), "masked positions of the per-token loss"
        (loss_tok * b.w_tok).sum().backward()
        loss = loss_tok
    else:
        assert loss.dim() == 0
        loss.backward()
    return loss.detach(), metrics, grad_rows(leaf, layout, b.total)


def run_padded_loss(b, backend, Q, opts):
    logits = b.pad(b.logits).requires_grad_()
    loss, metrics = pk.ppo_loss(logits, b.padded_tokens, response_mask=b.padded_mask,
                                backend=backend, **Q, **opts)
    if opts.get("loss_agg_mode") == "none":
        assert torch.all(loss[~b.padded_mask] == 0)
        (loss * b.pad(b.w_tok)).sum().backward()
        loss = b.unpad(loss)
    else:
        loss.backward()
    g = logits.grad
    assert torch.all(g[~b.pad(torch.ones(b.total, dtype=torch.bool), False)] == 0)
    return loss.detach(), metrics, b.unpad(g)


def check_loss(b, layout, backend, opts, tol, nonzero=False, **inputs):
    P, Q = loss_inputs(b, **inputs)
    lp, mp, gp = run_packed_loss(b, layout, backend, P, opts)
    lq, mq, gq = run_padded_loss(b, backend, Q, opts)
    if nonzero:  # the comparison is not between two zeros
        assert float(gq.abs().max()) > 0 and float(lq.abs().max()) > 0
        assert float(mq["num_tokens"]) == float(b.mask.sum())
    if lq.dim() == 0:
        # the two layouts sum the same terms in another order: float32 rounding is relative
        # to sum |w_t l_t|, not to the total, which may cancel
        none = dict(opts, loss_agg_mode="none")
        per_tok, _ = pk.ppo_loss(b.pad(b.logits), b.padded_tokens, response_mask=b.padded_mask,
                                 backend=backend, **Q, **none)
        w = pk._torch_impl.agg_weights(b.padded_mask, opts["loss_agg_mode"],
                                       opts.get("global_num_tokens"), opts.get("norm_length"),
                                       dtype=torch.float64,
                                       global_num_seqs=opts.get("global_num_seqs"))
        scale = max(float((w * per_tok.double().abs()).sum()), float(lq.abs()), 1e-30)
        e = float((lp.double() - lq.double()).abs()) / scale
        assert e <= tol, f"loss: error {e:.3g} of sum |w l| > {tol}"
    else:
        assert_same(lp, lq, tol, "loss")
    assert set(mp) == set(mq), set(mp) ^ set(mq)
    for k in mq:
        assert mp[k].dim() == 0 and not mp[k].requires_grad, k
        assert_same(mp[k], mq[k], tol, f"metric {k}")
    assert_same(gp, gq, tol, "dlogits")
    return lp, mp, gp


def _opts(policy, mode, **kw):
    o = dict(policy_loss=policy, loss_agg_mode=mode)
    if policy == "cispo":
        o.update(clip_eps_low=1.0, clip_eps_high=4.0)
    if policy in ("gspo", "gspo-token"):  # a band the sequence ratios fall on both sides of
        o.update(clip_eps_low=0.1, clip_eps_high=0.15)
    if policy in ("dppo-tv", "dppo-kl"):  # thresholds the batch's tokens cross both ways
        o.update(clip_eps_low=0.002, clip_eps_high=0.004)
    o.update(kw)
    return o


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "none"])
@pytest.mark.parametrize("be", BACKENDS_FAST)
def test_loss_vespo_packed_matches_padded(be, mode):
    """VESPO's sequence weight over packed sequences (empty and length-1 ones included):
    the packed layout gives the padded one's loss, metrics and gradient (VESPO takes no
    rollout correction, so it is not in POLICIES' rollout-correction tests)."""
    b = Batch(EDGE_LENS["mixed"], 23, seed=zlib.crc32(f"vespo/{mode}".encode()) % 1000)
    check_loss(b, "flat", be.name, _opts("vespo", mode, kl_coef=0.0), TOL32, nonzero=True)


@pytest.mark.parametrize("mode", AGG)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("be", BACKENDS_FAST)
def test_loss_every_policy_and_mode(be, policy, mode):
    """Every policy loss x aggregation mode, a ragged batch with empty and length-1
    sequences, NaN on masked positions, confident tokens; per-token advantages."""
    b = Batch(EDGE_LENS["mixed"], 23, seed=zlib.crc32(f"{policy}/{mode}".encode()) % 1000)
    check_loss(b, "flat", be.name, _opts(policy, mode, kl_coef=0.0), TOL32, nonzero=True)


@pytest.mark.parametrize("name", sorted(EDGE_LENS))
@pytest.mark.parametrize("layout", ["flat", "row", "raw"])
@pytest.mark.parametrize("be", BACKENDS_FAST)
def test_loss_edge_batches_and_layouts(be, layout, name):
    """The edge ragged batches in the three packed layouts, gspo (two-phase path) and
    vanilla with KL, entropy and a temperature (fused path), per-sequence advantages."""
    b = Batch(EDGE_LENS[name], 17, seed=len(name) * 7 + len(layout))
    check_loss(b, layout, be.name, _opts("gspo", "seq-mean-token-mean", entropy_coef=0.01,
                                         temperature=0.7), TOL32, adv="seq")
    check_loss(b, layout, be.name, _opts("vanilla", "token-mean", entropy_coef=0.02,
                                         temperature=1.3, dual_clip_c=3.0), TOL32,
               adv="seq1" if b.S != b.total else "seq", kl=0.1)  # (S == total: see below)


@pytest.mark.parametrize("rc", RC + ["off-policy"])
@pytest.mark.parametrize("be", BACKENDS_FAST)
def test_loss_rollout_corrections(be, rc):
    """The rollout correction modes and the off-policy mask reduce over each packed
    sequence: per-token and per-sequence rollout_is_weights on top."""
    b = Batch(EDGE_LENS["mixed"] + [4], 19, seed=len(rc))
    for isw, policy, mode in ((None, "vanilla", "token-mean"),
                              ("tok", "gspo", "seq-mean-token-sum"),
                              ("seq", "sapo", "none")):
        if rc == "off-policy":
            inputs = dict(off=0.01)
        else:
            inputs = dict(rc=rc)
        opts = _opts(policy, mode)
        if rc == "geo-seq":
            opts["rollout_is_threshold"] = 1.3
        elif rc != "off-policy":
            opts["rollout_is_threshold"] = (0.6, 1.5)
        check_loss(b, "row", be.name, opts, TOL32, isw=isw, adv="seq", **inputs)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("be", BACKENDS_FAST)
def test_loss_on_policy_old_none(be, policy):
    """old_logprobs=None (on-policy) with packed sequences."""
    b = Batch([4, 0, 2, 1], 13, seed=5)
    for mode in ("token-mean", "seq-mean-token-sum-norm", "none"):
        check_loss(b, "flat", be.name, _opts(policy, mode), TOL32, old=False, adv="seq")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("be", TRITON)
def test_loss_triton_interpreter(be, policy):
    """The Triton kernels (interpreter) on a small packed batch, both the fused and the
    two-phase paths."""
    b = Batch(TRITON_LENS, 40, seed=11)
    for mode in ("seq-mean-token-mean", "none"):
        check_loss(b, "row", "triton", _opts(policy, mode, entropy_coef=0.01), TOL32,
                   adv="seq", isw="tok")
    check_loss(b, "flat", "triton", _opts(policy, "token-mean"), TOL32, rc="tis-seq",
               adv="tok")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("policy", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("be", BACKENDS_FAST)
def test_loss_half_precision(be, policy, dtype):
    b = Batch(EDGE_LENS["mixed"], 29, seed=3, dtype=dtype)
    for mode in ("token-mean", "seq-mean-token-mean", "none"):
        check_loss(b, "row", be.name, _opts(policy, mode, entropy_coef=0.01), TOL16,
                   adv="seq")


@pytest.mark.parametrize("be", TRITON)
def test_loss_bfloat16_triton(be):
    b = Batch(TRITON_LENS, 40, seed=4, dtype=torch.bfloat16)
    check_loss(b, "flat", "triton", _opts("gspo", "seq-mean-token-sum"), TOL16, adv="seq")
    check_loss(b, "flat", "triton", _opts("vanilla", "token-mean"), TOL16, adv="tok")


def test_loss_all_empty_and_no_sequences():
    """Every sequence empty (total = 0), and S = 0 (cu_seqlens = [0]): a zero loss, zero
    metrics, an empty gradient, for every policy and mode."""
    for lens in ([0, 0, 0], []):
        b = Batch(lens, 7, seed=1)
        for be in ("cpu", "torch"):
            for policy in POLICIES:
                for mode in AGG:
                    leaf = b.logits.clone().requires_grad_()
                    loss, m = pk.ppo_loss(leaf, b.tokens, b.p["old"], b.seq["adv"],
                                          response_mask=b.mask, cu_seqlens=b.cu,
                                          policy_loss=policy, loss_agg_mode=mode, backend=be)
                    if mode == "none":
                        assert loss.shape == (0,)
                    else:
                        assert loss.dim() == 0 and float(loss.detach()) == 0.0
                        loss.backward()
                        assert leaf.grad is not None and leaf.grad.shape == (0, 7)
                    assert float(m["num_tokens"]) == 0 and float(m["num_seqs"]) == 0
                    assert all(torch.isfinite(v) for v in m.values())


def test_loss_fully_masked_sequences_match_padded():
    """Sequences whose every position is masked (length > 0, no valid token)."""
    b = Batch([3, 2, 4], 11, seed=8, p_mask=0.0)
    b.mask[3:5] = False  # the second sequence is all masked
    for k in b.p:
        b.p[k] = torch.where(b.mask, b.p[k], float("nan"))
    b.tokens = torch.where(b.mask, b.tokens, -3)
    for policy in POLICIES:
        for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "none"):
            check_loss(b, "flat", "cpu", _opts(policy, mode), TOL32, adv="seq", rc="geo-seq")


def test_max_seqlen_is_only_a_hint():
    """max_seqlen (an upper bound of the longest sequence, as flash-attn takes it) saves a
    host read: it must not change any result, the seq-mean-token-sum-norm length included
    (whose default T is the padded width)."""
    b = Batch([3, 0, 1, 5], 11, seed=2)
    for policy in ("vanilla", "gspo"):
        for mode in AGG:
            for be in ("cpu", "torch"):
                outs = []
                for ms in (None, 5, 9):
                    leaf = b.logits.clone().requires_grad_()
                    loss, m = pk.ppo_loss(leaf, b.tokens, b.p["old"], b.seq["adv"],
                                          response_mask=b.mask, cu_seqlens=b.cu,
                                          max_seqlen=ms, policy_loss=policy,
                                          loss_agg_mode=mode, backend=be)
                    (loss * b.w_tok if mode == "none" else loss).sum().backward()
                    outs.append((loss.detach(), m, leaf.grad))
                for ms, (lo, mo, go) in zip((5, 9), outs[1:]):
                    what = f"{policy} {mode} {be} max_seqlen={ms}"
                    assert_same(lo, outs[0][0], TOL32, what + " loss")
                    assert_same(go, outs[0][2], TOL32, what + " dlogits")
                    for k in mo:
                        assert_same(mo[k], outs[0][1][k], TOL32, what + f" metric {k}")


def test_per_sequence_inputs_when_num_seqs_equals_total():
    """Per-sequence advantages [S, 1] are unambiguous even when S == total (here with an
    empty sequence and a length-2 one): they must be spread over each sequence's tokens,
    as [S, 1] is in the padded layout."""
    b = Batch([2, 0, 1], 9, seed=6, p_mask=0.0)
    assert b.S == b.total
    check_loss(b, "flat", "cpu", _opts("vanilla", "token-mean"), TOL32, adv="seq1")


def test_loss_nan_logits_on_masked_positions():
    """Masked positions are never read: NaN / inf logits there change nothing (packed
    rows of masked tokens, kernel backends)."""
    b = Batch([3, 0, 4, 2], 13, seed=9, p_mask=0.3)
    ref = check_loss(b, "flat", "cpu", _opts("gspo", "seq-mean-token-mean"), TOL32, adv="seq")
    b.logits = torch.where(b.mask[:, None], b.logits, float("nan"))
    b.logits[~b.mask, 0] = float("inf")
    P, _ = loss_inputs(b, adv="seq")
    lp, mp, gp = run_packed_loss(b, "flat", "cpu", P, _opts("gspo", "seq-mean-token-mean"))
    assert_same(lp, ref[0], 0.0, "loss")
    assert_same(gp, ref[2], 0.0, "dlogits")
    assert torch.all(gp[~b.mask] == 0)


@st.composite
def packed_problems(draw):
    lens = draw(st.lists(st.integers(0, 7), min_size=1, max_size=5))
    V = draw(st.sampled_from([1, 2, 5, 17, 64]))
    policy = draw(st.sampled_from(POLICIES))
    mode = draw(st.sampled_from(AGG))
    opts = _opts(policy, mode,
                 entropy_coef=draw(st.sampled_from([0.0, 0.01])),
                 temperature=draw(st.sampled_from([1.0, 0.6, 1.7])))
    if policy in ("vanilla", "gspo", "gspo-token") and draw(st.booleans()):
        opts["dual_clip_c"] = 3.0 if policy == "vanilla" else 1.5
    rc = draw(st.sampled_from([None, None] + RC))
    if rc is not None:
        opts["rollout_is_threshold"] = 1.5 if rc == "geo-seq" else draw(
            st.sampled_from([2.0, (0.6, 1.5)]))
    inputs = dict(adv=draw(st.sampled_from(["tok", "seq", "seq1"])),
                  isw=draw(st.sampled_from([None, "tok", "seq"])),
                  old=rc is not None or draw(st.integers(0, 3)) > 0,
                  rc=rc, off=draw(st.sampled_from([None, None, 0.0, 0.05])),
                  kl=draw(st.sampled_from([0.0, 0.1])))
    if inputs["adv"] == "seq1" and len(lens) == sum(lens) and len(lens) > 1:
        inputs["adv"] = "seq"  # [S, 1] with S == total: test_per_sequence_inputs_...
    if (inputs["adv"] == "seq" or inputs["isw"] == "seq") and len(lens) == sum(lens):
        inputs["adv"], inputs["isw"] = "tok", (None if inputs["isw"] == "seq" else
                                                inputs["isw"])  # [S] = [total]: ambiguous
    layout = draw(st.sampled_from(["flat", "row", "raw"]))
    return lens, V, draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from([0.0, 0.3])), \
        opts, inputs, layout


@SETTINGS
@given(packed_problems())
def test_loss_random_ragged(problem):
    lens, V, seed, p_mask, opts, inputs, layout = problem
    b = Batch(lens, V, seed, p_mask=p_mask)
    for be in ("cpu", "torch"):
        check_loss(b, layout, be, opts, TOL32, **inputs)


# ------------------------------------------------------------------ gradcheck


@pytest.mark.parametrize("policy", ["vanilla", "gspo"])
@pytest.mark.parametrize("be", BACKENDS_FAST)
def test_gradcheck_float64(be, policy):
    b = Batch([2, 0, 3, 1], 5, seed=12, dtype=torch.float64, confident=0.0)
    for mode in ("token-mean", "seq-mean-token-mean"):
        def f(x):
            return pk.ppo_loss(x, b.tokens, b.p["old"], b.seq["adv"], response_mask=b.mask,
                               cu_seqlens=b.cu, policy_loss=policy, loss_agg_mode=mode,
                               entropy_coef=0.05, backend=be.name,
                               **(dict(clip_eps_low=0.05, clip_eps_high=0.06)
                                  if policy == "gspo" else {}))[0]
        x = b.logits.clone().requires_grad_()
        assert torch.autograd.gradcheck(f, (x,), eps=1e-6, atol=1e-8, rtol=1e-6)


# ------------------------------------------------------------------ from hidden


@pytest.mark.parametrize("policy", ["vanilla", "gspo", "sapo"])
@pytest.mark.parametrize("be", BACKENDS)
def test_loss_from_hidden(be, policy):
    lens = TRITON_LENS if be.small else EDGE_LENS["mixed"]
    b = Batch(lens, 37, seed=13, H=8)
    modes = ("seq-mean-token-mean", "none") if be.small else ("token-mean",
                                                              "seq-mean-token-sum-norm", "none")
    for mode in modes:
        for layout in ("flat", "row"):
            opts = _opts(policy, mode, entropy_coef=0.01)
            P, Q = loss_inputs(b, adv="seq", rc="tis")
            h = shaped(b.hidden, layout).clone().requires_grad_()
            w = b.weight.clone().requires_grad_()
            kw = {k: (shaped(v, layout) if isinstance(v, torch.Tensor) and
                      v.shape[0] == b.total else v) for k, v in P.items()}
            loss, m = pk.ppo_loss_from_hidden(h, w, shaped(b.tokens, layout),
                                              response_mask=shaped(b.mask, layout),
                                              cu_seqlens=b.cu, backend=be.name, chunk_size=3,
                                              **kw, **opts)
            hq = b.pad(b.hidden).requires_grad_()
            wq = b.weight.clone().requires_grad_()
            lq, mq = pk.ppo_loss_from_hidden(hq, wq, b.padded_tokens,
                                             response_mask=b.padded_mask, backend=be.name,
                                             chunk_size=3, **Q, **opts)
            if mode == "none":
                loss = loss.reshape(b.total)
                lq = b.unpad(lq)
                (loss * b.w_tok).sum().backward()
                (lq * b.w_tok).sum().backward()
            else:
                loss.backward()
                lq.backward()
            assert_same(loss, lq, TOL32, "loss")
            for k in mq:
                assert_same(m[k], mq[k], TOL32, f"metric {k}")
            assert_same(h.grad.reshape(b.total, -1), b.unpad(hq.grad), TOL32, "dhidden")
            assert_same(w.grad, wq.grad, TOL32, "dW")


# ------------------------------------------------------------------ rollout side


def _padded_seq_inputs(b):
    return b.pad(b.p["rewards"]), b.pad(b.p["values"]), b.padded_mask


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("name", sorted(EDGE_LENS) + ["all-empty", "long"])
def test_gae(be, name):
    """(long: sequences past the interpreter's 8-long GAE chunk)"""
    lens = EDGE_LENS.get(name, [0, 0] if name == "all-empty" else [11, 0, 3, 9])
    b = Batch(lens, 3, seed=len(name))
    for layout in ("flat", "row"):
        boot = torch.randn(b.S, generator=torch.Generator().manual_seed(b.S))
        for gamma, lam, bv in ((1.0, 0.95, None), (0.9, 1.0, boot), (0.99, 0.0, None),
                               (0.97, 0.9, boot)):
            a, r = pk.gae(shaped(b.p["rewards"], layout), shaped(b.p["values"], layout),
                          shaped(b.mask, layout), gamma=gamma, lam=lam, bootstrap_values=bv,
                          cu_seqlens=b.cu, backend=be.name)
            assert a.shape == shaped(b.mask, layout).shape and r.shape == a.shape
            if b.L == 0:
                assert a.numel() == 0
                continue
            aq, rq = pk.gae(*_padded_seq_inputs(b), gamma=gamma, lam=lam, bootstrap_values=bv,
                            backend=be.name)
            assert_same(a.reshape(-1), b.unpad(aq), TOL32, "advantages")
            assert_same(r.reshape(-1), b.unpad(rq), TOL32, "returns")
            assert torch.all(a.reshape(-1)[~b.mask] == 0)


def test_gae_restarts_at_every_boundary():
    """With all-valid sequences, the packed scan must equal running gae on each sequence
    alone (nothing carries across a boundary)."""
    b = Batch([3, 1, 5, 2], 3, seed=1, p_mask=0.0, nan=False)
    a, r = pk.gae(b.p["rewards"], b.p["values"], None, gamma=0.97, lam=0.9, cu_seqlens=b.cu)
    for s in range(b.S):
        lo, hi = int(b.cu[s]), int(b.cu[s + 1])
        aa, rr = pk.gae(b.p["rewards"][None, lo:hi], b.p["values"][None, lo:hi], None,
                        gamma=0.97, lam=0.9)
        assert_same(a[lo:hi], aa[0], TOL32, f"sequence {s}")
        assert_same(r[lo:hi], rr[0], TOL32, f"sequence {s} returns")


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("name", sorted(EDGE_LENS) + ["long"])
def test_gae_vapo_lambdas(be, name):
    """Length-adaptive lambda per PACKED sequence (its own valid-token count) and the
    decoupled value_lam: the padded copy's results and the float64 reference's."""
    lens = EDGE_LENS.get(name, [11, 0, 3, 9])
    b = Batch(lens, 3, seed=7 + len(name))
    for kw in (dict(lam="length-adaptive", lam_alpha=0.3),
               dict(lam="length-adaptive", lam_alpha=0.3, value_lam=1.0),
               dict(lam=0.9, value_lam=0.5)):
        for layout in ("flat", "row"):
            a, r = pk.gae(shaped(b.p["rewards"], layout), shaped(b.p["values"], layout),
                          shaped(b.mask, layout), gamma=0.99, cu_seqlens=b.cu,
                          backend=be.name, **kw)
            assert a.shape == shaped(b.mask, layout).shape and r.shape == a.shape
            if b.L == 0:
                continue
            aq, rq = pk.gae(*_padded_seq_inputs(b), gamma=0.99, backend=be.name, **kw)
            assert_same(a.reshape(-1), b.unpad(aq), TOL32, f"advantages {kw}")
            assert_same(r.reshape(-1), b.unpad(rq), TOL32, f"returns {kw}")
            ea, er = R.gae(*_padded_seq_inputs(b), gamma=0.99, **kw)
            assert_same(a.reshape(-1), b.unpad(torch.from_numpy(ea).float()), TOL32, "ref adv")
            assert_same(r.reshape(-1), b.unpad(torch.from_numpy(er).float()), TOL32, "ref ret")


@pytest.mark.parametrize("be", BACKENDS)
def test_score_rollout_vapo_lambdas(be):
    b = Batch(TRITON_LENS if be.small else EDGE_LENS["mixed"], 31, seed=9)
    kw = dict(kl_coef=0.05, gamma=0.99, lam="length-adaptive", lam_alpha=0.3, value_lam=1.0,
              whiten=False)
    _, logits = packed_logits(b, "row", requires_grad=False)
    out = pk.score_rollout(logits, shaped(b.tokens, "row"), shaped(b.p["ref"], "row"),
                           shaped(b.p["values"], "row"), b.seq["scores"],
                           shaped(b.mask, "row"), cu_seqlens=b.cu, backend=be.name, **kw)
    outq = pk.score_rollout(b.pad(b.logits), b.padded_tokens, b.pad(b.p["ref"]),
                            b.pad(b.p["values"]), b.seq["scores"], b.padded_mask,
                            backend=be.name, **kw)
    for f, x, xq in zip(out._fields, out, outq):
        assert_same(x.reshape(-1), b.unpad(xq), TOL32, f)


@pytest.mark.parametrize("name", sorted(EDGE_LENS))
def test_kl_penalized_rewards(name):
    b = Batch(EDGE_LENS[name], 3, seed=3)
    for est in ("k1", "k2", "k3", "abs"):
        for layout in ("flat", "row"):
            r = pk.kl_penalized_rewards(b.seq["scores"], shaped(b.p["old"], layout),
                                        shaped(b.p["ref"], layout), shaped(b.mask, layout),
                                        kl_coef=0.1, kl_estimator=est, cu_seqlens=b.cu)
            rq = pk.kl_penalized_rewards(b.seq["scores"], b.pad(b.p["old"]),
                                         b.pad(b.p["ref"]), b.padded_mask, kl_coef=0.1,
                                         kl_estimator=est)
            assert r.shape == shaped(b.mask, layout).shape
            assert_same(r.reshape(-1), b.unpad(rq), TOL32, f"rewards {est}")


@pytest.mark.parametrize("name", sorted(EDGE_LENS))
def test_whiten(name):
    b = Batch(EDGE_LENS[name], 3, seed=4)
    for shift in (True, False):
        for layout in ("flat", "row"):
            x = shaped(b.p["x"], layout).clone().requires_grad_()
            y = pk.whiten(x, shaped(b.mask, layout), shift_mean=shift, cu_seqlens=b.cu)
            xq = b.pad(b.p["x"]).requires_grad_()
            yq = pk.whiten(xq, b.padded_mask, shift_mean=shift)
            assert y.shape == x.shape
            assert_same(y.reshape(-1), b.unpad(yq), TOL32, "whiten")
            (y.reshape(-1) * b.w_tok).sum().backward()
            (b.unpad(yq) * b.w_tok).sum().backward()
            assert_same(x.grad.reshape(-1), b.unpad(xq.grad), TOL32, "d whiten")


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("name", sorted(EDGE_LENS))
def test_score_rollout(be, name):
    lens = EDGE_LENS[name]
    if be.small and sum(lens) > 16:
        lens = TRITON_LENS
    dtypes = ((torch.float32, TOL32), (torch.bfloat16, TOL16))
    if be.small and name != "mixed":
        dtypes = dtypes[:1]
    for dtype, tol in dtypes:
        b = Batch(lens, 31, seed=5 + len(name), dtype=dtype)
        for layout in (("flat", "row", "raw") if not be.small else ("row",)):
            for whiten in (True, False):
                _, logits = packed_logits(b, layout, requires_grad=False)
                out = pk.score_rollout(logits, shaped(b.tokens, layout),
                                       shaped(b.p["ref"], layout),
                                       shaped(b.p["values"], layout), b.seq["scores"],
                                       shaped(b.mask, layout), kl_coef=0.05, gamma=0.99,
                                       lam=0.9, temperature=0.8, whiten=whiten,
                                       cu_seqlens=b.cu, backend=be.name)
                outq = pk.score_rollout(b.pad(b.logits), b.padded_tokens, b.pad(b.p["ref"]),
                                        b.pad(b.p["values"]), b.seq["scores"], b.padded_mask,
                                        kl_coef=0.05, gamma=0.99, lam=0.9, temperature=0.8,
                                        whiten=whiten, backend=be.name)
                for f, x, xq in zip(out._fields, out, outq):
                    assert x.shape == shaped(b.mask, layout).shape, f
                    assert x.dtype == torch.float32, f
                    assert_same(x.reshape(-1), b.unpad(xq), tol, f"{f} {layout}")
                    assert torch.all(x.reshape(-1)[~b.mask] == 0), f


def test_score_rollout_all_empty():
    b = Batch([0, 0], 7, seed=1)
    out = pk.score_rollout(b.logits, b.tokens, b.p["ref"], b.p["values"], b.seq["scores"],
                           b.mask, kl_coef=0.1, cu_seqlens=b.cu)
    assert all(x.shape == (0,) for x in out)


# ------------------------------------------------------------------ bad arguments
# (errors are ValueError or TypeError naming the argument: never an IndexError or a crash)

def _packed_ops(d):
    """name -> f(**packing kwargs): every op that takes cu_seqlens, on the packed batch."""
    return {
        "ppo_loss-cpu": lambda **kw: pk.ppo_loss(d["logits"], d["tokens"], d["old"], d["adv"],
                                                 d["mask"], backend="cpu", **kw),
        "ppo_loss-torch-gspo": lambda **kw: pk.ppo_loss(
            d["logits"], d["tokens"], d["old"], d["adv"], d["mask"], policy_loss="gspo",
            backend="torch", **kw),
        "ppo_loss_from_hidden": lambda **kw: pk.ppo_loss_from_hidden(
            d["hidden"], d["weight"], d["tokens"], d["old"], d["adv"], d["mask"], **kw),
        "score_rollout": lambda **kw: pk.score_rollout(
            d["logits"], d["tokens"], d["old"], d["values"], d["scores"], d["mask"],
            kl_coef=0.1, **kw),
        "gae": lambda **kw: pk.gae(d["adv"], d["values"], d["mask"], **kw),
        "kl_penalized_rewards": lambda **kw: pk.kl_penalized_rewards(
            d["scores"], d["old"], d["values"], d["mask"], kl_coef=0.1, **kw),
        "whiten": lambda **kw: pk.whiten(d["adv"], d["mask"], **kw),
    }


PACKED_OPS = sorted(_packed_ops(packed_batch()))


def test_the_packed_batch_is_fine():
    """The good batch the bad inputs below start from runs on every op."""
    for name, op in _packed_ops(packed_batch()).items():
        op(cu_seqlens=PK_CU)
        op(cu_seqlens=PK_CU.long(), max_seqlen=3)
        op(cu_seqlens=PK_CU, max_seqlen=7)


BAD_CU = {
    "float": torch.tensor([0.0, 3.0, 3.0, 5.0]),
    "bool": torch.tensor([False, True, True, True]),
    "list": [0, 3, 3, 5],
    "2-D": torch.tensor([[0, 3, 3, 5]], dtype=torch.int32),
    "2-D-column": torch.tensor([[0], [3], [3], [5]], dtype=torch.int32),
    "0-D": torch.tensor(5, dtype=torch.int32),
    "empty": torch.tensor([], dtype=torch.int32),
    "not-starting-at-0": torch.tensor([1, 3, 3, 5], dtype=torch.int32),
    "negative-start": torch.tensor([-1, 3, 3, 5], dtype=torch.int32),
    "decreasing": torch.tensor([0, 4, 3, 5], dtype=torch.int32),
    "short-of-total": torch.tensor([0, 3, 3, 4], dtype=torch.int32),
    "past-total": torch.tensor([0, 3, 3, 6], dtype=torch.int32),
    "only-zero": torch.tensor([0], dtype=torch.int32),
}


@pytest.mark.parametrize("case", sorted(BAD_CU))
@pytest.mark.parametrize("op", PACKED_OPS)
def test_bad_cu_seqlens(op, case):
    """cu_seqlens of a wrong dtype, type or shape, empty, not starting at 0, decreasing,
    or not ending at the total: an error naming cu_seqlens (with and without max_seqlen), on
    every op that takes it."""
    fn = _packed_ops(packed_batch())[op]
    raises_naming(lambda: fn(cu_seqlens=BAD_CU[case]), "cu_seqlens")
    raises_naming(lambda: fn(cu_seqlens=BAD_CU[case], max_seqlen=5), "cu_seqlens")


@pytest.mark.parametrize("value", [2, 0, -1, 2.5, 3.0, "3", True, torch.tensor(3)])
@pytest.mark.parametrize("op", PACKED_OPS)
def test_bad_max_seqlen(op, value):
    """Shorter than the longest sequence (3), negative, not an int."""
    fn = _packed_ops(packed_batch())[op]
    raises_naming(lambda: fn(cu_seqlens=PK_CU, max_seqlen=value), "max_seqlen")


def test_max_seqlen_without_cu_seqlens():
    """max_seqlen without cu_seqlens is an error naming max_seqlen, on every op."""
    g = torch.Generator().manual_seed(1)
    B, T = 2, 4
    lg, tok = torch.randn(B, T, PK_V, generator=g), torch.randint(0, PK_V, (B, T), generator=g)
    x = torch.randn(B, T, generator=g)
    m = torch.ones(B, T, dtype=torch.bool)
    calls = [
        lambda: pk.ppo_loss(lg, tok, x, x, m, max_seqlen=4),
        lambda: pk.ppo_loss_from_hidden(torch.randn(B, T, PK_H), torch.randn(PK_V, PK_H), tok, x,
                                        x, m, max_seqlen=4),
        lambda: pk.score_rollout(lg, tok, x, x, torch.randn(B), m, kl_coef=0.1, max_seqlen=4),
        lambda: pk.gae(x, x, m, max_seqlen=4),
        lambda: pk.kl_penalized_rewards(torch.randn(B), x, x, m, kl_coef=0.1, max_seqlen=4),
        lambda: pk.whiten(x, m, max_seqlen=4),
    ]
    for c in calls:
        raises_naming(c, "max_seqlen")


def test_cu_seqlens_with_a_padded_batch():
    """[B, T] inputs with B > 1 are not a packed layout."""
    g = torch.Generator().manual_seed(2)
    B, T = 2, 4
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)  # total = B * T: still not packed
    lg, tok = torch.randn(B, T, PK_V, generator=g), torch.randint(0, PK_V, (B, T), generator=g)
    x = torch.randn(B, T, generator=g)
    m = torch.ones(B, T, dtype=torch.bool)
    for c, name in [
        (lambda: pk.ppo_loss(lg, tok, x, x, m, cu_seqlens=cu), "tokens"),
        (lambda: pk.ppo_loss(lg, tok, x, x, m, cu_seqlens=cu, policy_loss="gspo",
                             backend="torch"), "tokens"),
        (lambda: pk.ppo_loss_from_hidden(torch.randn(B, T, PK_H), torch.randn(PK_V, PK_H), tok,
                                         x, x, m, cu_seqlens=cu), "tokens"),
        (lambda: pk.score_rollout(lg, tok, x, x, torch.randn(2), m, kl_coef=0.1,
                                  cu_seqlens=cu), "tokens"),
        (lambda: pk.gae(x, x, m, cu_seqlens=cu), "rewards"),
        (lambda: pk.kl_penalized_rewards(torch.randn(2), x, x, m, kl_coef=0.1,
                                         cu_seqlens=cu), "logprobs"),
        (lambda: pk.whiten(x, m, cu_seqlens=cu), "x"),
    ]:
        e = raises_naming(c, name)
        assert "cu_seqlens" in str(e), e


@pytest.mark.parametrize("shape", [(PK_S + 1,), (PK_TOTAL + 1,), (PK_S, 2), (1, PK_TOTAL + 1),
                                   (PK_S, 3), (PK_TOTAL, 1), (2, PK_TOTAL)])
def test_per_token_inputs_of_a_wrong_length(shape):
    """advantages, rollout_is_weights, old_logprobs, ref_logprobs, rollout_logprobs,
    response_mask of a shape neither [total], [1, total] nor (the first two) [S] / [S, 1]."""
    d = packed_batch()
    bad = torch.randn(shape)
    base = dict(old_logprobs=d["old"], advantages=d["adv"], response_mask=d["mask"],
                cu_seqlens=PK_CU)
    for name, extra in [("advantages", {}), ("rollout_is_weights", {}),
                        ("old_logprobs", {}), ("ref_logprobs", dict(kl_coef=0.1)),
                        ("rollout_logprobs", dict(rollout_correction="tis")),
                        ("response_mask", {})]:
        for be, pl in (("cpu", "vanilla"), ("cpu", "gspo"), ("torch", "gspo")):
            kw = dict(base, policy_loss=pl, backend=be, **extra)
            if name == "ref_logprobs" or name == "rollout_logprobs":
                kw.setdefault("ref_logprobs", d["old"])
                kw.setdefault("rollout_logprobs", d["old"])
            kw[name] = bad if name != "response_mask" else bad > 0
            raises_naming(lambda: pk.ppo_loss(d["logits"], d["tokens"], **kw), name)


def test_rollout_side_inputs_of_a_wrong_length():
    """gae's values / bootstrap_values, kl_penalized_rewards' scores / ref_logprobs,
    score_rollout's scores / values and whiten's mask of a wrong length with cu_seqlens:
    errors naming them."""
    d = packed_batch()
    bad = torch.randn(PK_TOTAL + 1)
    raises_naming(lambda: pk.gae(d["adv"], bad, d["mask"], cu_seqlens=PK_CU), "values")
    raises_naming(lambda: pk.gae(d["adv"], d["values"], d["mask"], cu_seqlens=PK_CU,
                                 bootstrap_values=torch.randn(PK_S + 1)),
                  "bootstrap_values")
    raises_naming(lambda: pk.kl_penalized_rewards(torch.randn(PK_S + 1), d["old"],
                                                  d["values"], d["mask"], kl_coef=0.1,
                                                  cu_seqlens=PK_CU), "scores")
    raises_naming(lambda: pk.kl_penalized_rewards(d["scores"], d["old"], bad, d["mask"],
                                                  kl_coef=0.1, cu_seqlens=PK_CU),
                  "ref_logprobs")
    raises_naming(lambda: pk.score_rollout(d["logits"], d["tokens"], d["old"], d["values"],
                                           torch.randn(PK_S - 1), d["mask"], kl_coef=0.1,
                                           cu_seqlens=PK_CU), "scores")
    raises_naming(lambda: pk.score_rollout(d["logits"], d["tokens"], d["old"], bad,
                                           d["scores"], d["mask"], kl_coef=0.1,
                                           cu_seqlens=PK_CU), "values")
    raises_naming(lambda: pk.whiten(d["adv"], bad > 0, cu_seqlens=PK_CU), "response_mask")
