"""Shared fixtures and helpers of the ppo_kernels test suite.

Backends (DESIGN.md): "cpu" and "torch" always run, on CPU tensors. "triton" runs on CPU
tensors under the Triton interpreter (TRITON_INTERPRET=1, set below before anything
imports triton) at small shapes only, when ppo_kernels.triton_kernels.library imports.
"cuda" and "triton_cuda" run on CUDA tensors only when a CUDA device is present (and the
extension was built with CUDA for "cuda"); otherwise they are skipped, never passed.
Every backend id contains the backend's name, so `pytest -k cuda` / `-k triton` select
them.

Test files import the helpers directly (`from conftest import ...`): tests/ has no
__init__.py, so pytest puts this directory on sys.path. The sections below: the backends
and fixtures; random inputs (make_mask, make_inputs, seeded_inputs, small_inputs,
one_token_rows, logits_for); comparisons (assert_close_np, assert_grad_close,
assert_metrics, compare_with_reference); the bad-input tables' base calls; the
torch.distributed helpers (a small packed batch, a 1-process group, the 2-process cases of
two_rank_cases.py, raises_naming); the raw Triton ops' helpers. The test files are named
for the module they test (tests/test_<module>[_<aspect>].py); tests/gpu/ holds the GPU
device checks that benchmarks/gpu_check.sh runs (no pytest files).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import fcntl  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels import reference as ref  # noqa: E402
from ppo_kernels.spec import FLOAT_SLOTS, INT_SLOTS  # noqa: E402
from ppo_kernels.testing import make_mask, one_token_rows  # noqa: E402,F401

# Hypothesis profiles (docs/TESTING.md): "ci", the default, is derandomized (the same
# examples every run: CI cannot flake on a new draw); HYPOTHESIS_PROFILE=random draws fresh
# examples each run, on demand, to look for new failures (then pin them with @example).
# The property tests' own @settings leave derandomize to the profile.
try:
    from hypothesis import settings as _hyp_settings
except ImportError:  # (hypothesis is a test dependency; tests without it still import)
    _hyp_settings = None
if _hyp_settings is not None:
    _hyp_settings.register_profile("ci", derandomize=True, deadline=None, database=None)
    _hyp_settings.register_profile("random", derandomize=False, deadline=None, database=None,
                                   print_blob=True)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_CUDA_DEVICE = torch.cuda.is_available()
CUDA_BUILT = bool(pk.build_info().get("cuda", False))
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _triton_ok():
    try:
        importlib.import_module("ppo_kernels.triton_kernels.library")
        return True
    except Exception:  # ImportError, or triton failing to initialise
        return False


TRITON_OK = _triton_ok()

if TRITON_OK and INTERPRET and not HAS_CUDA_DEVICE:
    import triton  # noqa: E402
    import triton.language as tl  # noqa: E402

    @triton.jit
    def _interpreter_probe_kernel(out_ptr, n):
        """A loop over a runtime bound, as every row kernel has (range(0, V, BLOCK_V))."""
        acc = tl.zeros([], tl.int32)
        for _ in range(0, n, 1):
            acc += 1
        tl.store(out_ptr, acc)


def _interpreter_broken():
    """None, or why triton's interpreter cannot run the kernels in this environment.

    Triton 3.6's interpreter converts a runtime integer argument to a Python int with
    int() of a 1-element array (its tensor __index__), which NumPy >= 2.4 rejects ("only
    0-dimensional arrays can be converted to Python scalars": the NumPy 1.25 deprecation
    expired), so every kernel's `range(0, V, BLOCK_V)` fails:
    https://github.com/triton-lang/triton/issues/9171, fixed upstream by
    https://github.com/triton-lang/triton/pull/9172 (triton 3.8 has it). The kernels on a
    GPU are not affected. Found by running a one-loop kernel, not by version numbers."""
    if not (TRITON_OK and INTERPRET and not HAS_CUDA_DEVICE):
        return None
    import triton
    out = torch.zeros(1, dtype=torch.int32)
    try:
        _interpreter_probe_kernel[(1,)](out, 3)
    except Exception as e:  # triton.runtime.errors.InterpreterError
        return (f"the triton {triton.__version__} interpreter cannot run a loop over a runtime "
                f"bound with numpy {np.__version__} ({e}; "
                f"https://github.com/triton-lang/triton/issues/9171): use numpy<2.4 or a "
                f"triton whose interpreter has the fix")
    if int(out.item()) != 3:
        return f"the triton {triton.__version__} interpreter ran a 3-step loop {int(out.item())} times"
    return None


INTERP_BROKEN = _interpreter_broken()


@dataclasses.dataclass(frozen=True)
class Backend:
    """A backend name as passed to the public API, and the device of its tensors.
    ``small``: the Triton interpreter, which only takes small shapes (V <= 300,
    B * T <= 16)."""

    name: str
    device: str
    small: bool = False

    def __str__(self):
        return f"{self.name}@{self.device}"

    def t(self, x):
        """Moves a tensor (or None) to this backend's device."""
        return None if x is None else x.to(self.device)


CPU = Backend("cpu", "cpu")
TORCH = Backend("torch", "cpu")
TRITON_INTERP = Backend("triton", "cpu", small=True)
CUDA = Backend("cuda", "cuda")
TRITON_CUDA = Backend("triton", "cuda")

_SKIP_INTERP = not (TRITON_OK and INTERPRET and not HAS_CUDA_DEVICE) or bool(INTERP_BROKEN)
_INTERP_REASON = INTERP_BROKEN or (
    "triton interpreter unavailable (ppo_kernels.triton_kernels.library does not "
    "import, TRITON_INTERPRET != 1, or a GPU is present and triton runs there)")


# marks a test that calls backend="triton" on CPU tensors itself
triton_interpreter = pytest.mark.skipif(_SKIP_INTERP, reason=_INTERP_REASON)


def backend_params(*, interp=True, cuda=True):
    """pytest.params of the backends; ids contain the backend name.

    interp=False leaves out the Triton interpreter (for shapes it is too slow for)."""
    params = [pytest.param(CPU, id="cpu"), pytest.param(TORCH, id="torch")]
    if interp:
        params.append(pytest.param(TRITON_INTERP, id="triton",
                                   marks=pytest.mark.skipif(_SKIP_INTERP, reason=_INTERP_REASON)))
    if cuda:
        params.append(pytest.param(CUDA, id="cuda", marks=pytest.mark.skipif(
            not (HAS_CUDA_DEVICE and CUDA_BUILT),
            reason="no CUDA device, or the extension was built without CUDA")))
        params.append(pytest.param(TRITON_CUDA, id="triton_cuda", marks=pytest.mark.skipif(
            not (HAS_CUDA_DEVICE and TRITON_OK), reason="no CUDA device or no triton")))
    return params


BACKENDS = backend_params()
BACKENDS_NO_INTERP = backend_params(interp=False)
BACKENDS_CPU = backend_params(cuda=False)  # cpu, torch, triton (interpreter): CPU tensors only
KERNELS_CPU = [p for p in BACKENDS_CPU if p.values[0].name != "torch"]  # the compiled kernels
POLICY_LOSSES = ["vanilla", "cispo", "sapo", "dppo-tv", "dppo-kl", "gspo", "gspo-token",
                 "vespo"]
# the fused kernels' (token-level) policy losses
TOKEN_LOSSES = ["vanilla", "cispo", "sapo", "dppo-tv", "dppo-kl"]
# the losses without a dual clip / ratio cap (dual_clip_c must be None)
NO_DUAL_CLIP = ("cispo", "sapo", "vespo")


@pytest.fixture(params=BACKENDS)
def be(request):
    return request.param


@pytest.fixture
def seed(request):
    """A seed that differs per test and per parametrisation (derived from the node id),
    stable from run to run."""
    return zlib.crc32(request.node.nodeid.encode())


@pytest.fixture
def gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ random inputs

PADDINGS = ("left", "right", "interior", "none", "random", "empty_row", "all")


# make_mask: ppo_kernels.testing's (public: users draw the same paddings)


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


def combine(backends, cases, case_id):
    """pytest.params of (backend, *case) for each backend and case, keeping the backend's
    marks and putting its id first; cases too large for the Triton interpreter (see
    interp_ok) are left out for it."""
    out = []
    for bp in backends:
        (b,) = bp.values
        for c in cases:
            if b.small and not interp_ok(*c):
                continue
            out.append(pytest.param(b, *c, id=f"{bp.id}-{case_id(*c)}", marks=bp.marks))
    return out


def interp_ok(*case):
    """Whether a case (its first three ints are B, T, V) is small enough for the Triton
    interpreter."""
    B, T, V = [x for x in case if isinstance(x, int) and not isinstance(x, bool)][:3]
    return V <= 300 and B * T <= 16


def loss_params(**kw):
    """The LossSpec the backends' ppo_loss takes, as pk.ppo_loss builds it (defaults of the
    public API; keyword arguments override)."""
    return pk.LossSpec.build(**kw)


def kernel_args(dtype=torch.float32, **kw):
    """(scalars, codes): the float[] / int[] the ppo_loss kernel ops take for LossSpec
    options kw (the logits of ``dtype``)."""
    return pk.LossSpec.build(**kw).kernel_args(dtype)


# ------------------------------------------------------------------ comparisons

def to_np(x):
    return x.detach().cpu().double().numpy()


def assert_close_np(actual, expected, rtol, atol, what=""):
    a = to_np(actual) if isinstance(actual, torch.Tensor) else np.asarray(actual, np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert not np.isnan(a).any(), f"{what}: NaN in output"
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=what)


def assert_grad_close(actual, expected, rel, what="dlogits", floor=1e-30):
    """max |actual - expected| <= rel * max |expected| + floor."""
    a = to_np(actual)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert np.isfinite(a).all(), f"{what}: non-finite values"
    scale = float(np.abs(e).max()) if e.size else 0.0
    err = float(np.abs(a - e).max()) if e.size else 0.0
    assert err <= rel * scale + floor, f"{what}: max abs err {err:.3e} vs scale {scale:.3e}"


# tolerances per logits dtype: (rtol loss/metrics, atol loss/metrics, rel dlogits)
TOL = {torch.float32: (2e-6, 2e-6, 3e-6), torch.bfloat16: (1e-5, 1e-5, 1e-2),
       torch.float16: (1e-5, 1e-5, 1e-2), torch.float64: (1e-10, 1e-11, 1e-10)}

METRIC_KEYS = {"num_tokens", "num_seqs", "clip_frac", "clip_frac_high", "clip_frac_low", "dual_clip_frac", "approx_kl",
               "kl_ref", "entropy", "ratio_mean", "ratio_max"}


# the option of ppo_loss -> the metric that shows it acted on some (not all) tokens
_RC_MASKING = ("mis", "mis-seq", "geo-seq")


def assert_active(metrics, kw=None, *fracs, **exact):
    """Asserts that the options a case names were active on its inputs, from the metrics
    ppo_loss returned (verl's tests assert ``masked_any > 0`` the same way): a case whose
    random inputs never switch an option on cannot catch a bug in it.

    From ``kw`` (ppo_loss's keyword arguments): dual_clip_c -> 0 < dual_clip_frac < 1;
    a DPPO loss with old_logprobs -> 0 < clip_frac < 1 (the trust region trips);
    rollout_correction mis / mis-seq / geo-seq -> 0 < rollout_masked_frac < 1; tis /
    tis-seq -> rollout_is_max == the upper bound (the truncation bites);
    off_policy_mask_threshold -> 0 < off_policy_masked_frac < 1. ``fracs``: more metric
    names that must lie strictly between 0 and 1; ``exact``: metric=value pairs."""
    kw = dict(kw or {})
    want = list(fracs)
    if kw.get("dual_clip_c") is not None:
        want.append("dual_clip_frac")
    if str(kw.get("policy_loss", "")).startswith("dppo") and kw.get("old", True) is not None:
        want.append("clip_frac")
    mode = kw.get("rollout_correction")
    if mode in _RC_MASKING:
        want.append("rollout_masked_frac")
    elif mode in ("tis", "tis-seq"):
        thr = kw.get("rollout_is_threshold", 2.0)
        exact.setdefault("rollout_is_max", thr[1] if isinstance(thr, (tuple, list)) else thr)
    if kw.get("off_policy_mask_threshold") is not None:
        want.append("off_policy_masked_frac")
    for k in want:
        v = float(metrics[k])
        assert 0.0 < v < 1.0, f"{k} = {v}: the option is inactive (0) or acts on everything"
    for k, v in exact.items():
        assert float(metrics[k]) == pytest.approx(v, rel=1e-6), \
            f"{k} = {float(metrics[k])}, expected {v}: the option is inactive"


def assert_metrics(metrics, expected, rtol=2e-6, atol=2e-6):
    assert set(metrics) == set(expected), set(metrics) ^ set(expected)
    for k, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0, k
        assert v.dtype == torch.float32, (k, v.dtype)
        assert not v.requires_grad, k
        assert_close_np(v, expected[k], rtol=rtol, atol=atol, what=f"metric {k}")


def compare_with_reference(be, logits, tokens, old, adv, mask, ref_lp, *, grad_rel=3e-6,
                           loss_rel=2e-6, metric_tol=2e-5, ref_kw=None, active=None, **kw):
    """Runs pk.ppo_loss on backend ``be`` (CPU tensors) and the reference on the same
    inputs; asserts loss, metrics (those the reference has) and dlogits agree. ``ref_kw``
    overrides arguments for the reference only (it takes [B, T, V] only). ``active``:
    None, or a tuple of extra metric names for assert_active, which then checks that the
    options in kw were active. Returns (loss, metrics, dlogits)."""
    leaf = logits.detach().clone().requires_grad_(True)
    loss, met = pk.ppo_loss(leaf, tokens, old, adv, mask, ref_lp, backend=be.name, **kw)
    (loss.sum() if loss.dim() else loss).backward()
    rk = dict(logits=logits.detach().double(), tokens=tokens, old=old, adv=adv, mask=mask,
              ref=ref_lp, kw=kw)
    rk.update(ref_kw or {})
    e_loss, e_met, e_grad = ref.ppo_loss(rk["logits"], rk["tokens"], rk["old"], rk["adv"],
                                         rk["mask"], rk["ref"], **rk["kw"])
    e_loss = np.asarray(e_loss).reshape(loss.shape)
    got = to_np(loss)
    assert np.isfinite(got).all(), "non-finite loss"
    np.testing.assert_allclose(got, e_loss, rtol=loss_rel,
                               atol=loss_rel * max(1.0, float(np.abs(e_loss).max(initial=0))))
    for k, v in met.items():
        assert v.dim() == 0 and v.dtype == torch.float32 and not v.requires_grad, k
        if k in e_met:
            assert math.isfinite(float(v)), k
            assert float(v) == pytest.approx(e_met[k], rel=metric_tol, abs=metric_tol), k
    g = to_np(leaf.grad).reshape(e_grad.shape)
    assert np.isfinite(g).all(), "non-finite dlogits"
    scale = float(np.abs(e_grad).max(initial=0.0))
    err = float(np.abs(g - e_grad).max(initial=0.0))
    assert err <= grad_rel * scale + 1e-30, f"dlogits: err {err:.3e} vs scale {scale:.3e}"
    if active is not None:
        assert_active(met, dict(kw, old=old), *active)
    return loss, met, leaf.grad


# ------------------------------------------------------------------ bad-input tables
# Every public function on valid inputs ([B, T] = [2, 3], V = 5, the cpu backend): a row of
# a bad-input table (test_loss_bad_inputs.py, test_advantages.py) replaces one argument.

BAD_B, BAD_T, BAD_V = 2, 3, 5
META = torch.device("meta")


def base_ppo():
    B, T, V = BAD_B, BAD_T, BAD_V
    g = torch.Generator().manual_seed(0)
    return dict(logits=torch.randn(B, T, V, generator=g), tokens=torch.randint(0, V, (B, T),
                                                                               generator=g),
                old_logprobs=-torch.rand(B, T, generator=g) - 1,
                advantages=torch.randn(B, T, generator=g),
                response_mask=torch.ones(B, T, dtype=torch.bool),
                ref_logprobs=-torch.rand(B, T, generator=g) - 1, backend="cpu")


def base_tlp():
    d = base_ppo()
    return dict(logits=d["logits"], tokens=d["tokens"], response_mask=d["response_mask"],
                backend="cpu")


def base_gae():
    B, T = BAD_B, BAD_T
    return dict(rewards=torch.randn(B, T), values=torch.randn(B, T),
                response_mask=torch.ones(B, T, dtype=torch.bool), backend="cpu")


def base_klr():
    B, T = BAD_B, BAD_T
    return dict(scores=torch.randn(B), logprobs=-torch.rand(B, T), ref_logprobs=-torch.rand(B, T),
                response_mask=torch.ones(B, T, dtype=torch.bool), kl_coef=0.1)


def base_whiten():
    B, T = BAD_B, BAD_T
    return dict(x=torch.randn(B, T), response_mask=torch.ones(B, T, dtype=torch.bool))


def base_score():
    B, T = BAD_B, BAD_T
    d = base_ppo()
    return dict(logits=d["logits"], tokens=d["tokens"], ref_logprobs=d["ref_logprobs"],
                values=torch.randn(B, T), scores=torch.randn(B),
                response_mask=d["response_mask"], kl_coef=0.1, backend="cpu")


def base_vl():
    B, T = BAD_B, BAD_T
    return dict(values=torch.randn(B, T), old_values=torch.randn(B, T), returns=torch.randn(B, T),
                response_mask=torch.ones(B, T, dtype=torch.bool))


PUBLIC_FUNCS = {"ppo_loss": (pk.ppo_loss, base_ppo),
                "token_logprobs": (pk.token_logprobs, base_tlp),
                "gae": (pk.gae, base_gae),
                "kl_penalized_rewards": (pk.kl_penalized_rewards, base_klr),
                "whiten": (pk.whiten, base_whiten),
                "score_rollout": (pk.score_rollout, base_score),
                "value_loss": (pk.value_loss, base_vl)}


def oob(value, pos=(1, 2)):
    """f(base dict) -> its tokens with ``value`` at ``pos`` (a row's derived value)."""
    def f(d):
        t = d["tokens"].clone()
        t[pos] = value
        return t
    return f


def bad_row_id(row):
    """A bad-input row's test id: function-argument-value."""
    fn, arg, val, exc, _ = row
    if callable(val) and not isinstance(val, torch.Tensor):
        desc = "derived"
    elif isinstance(val, torch.Tensor):
        desc = f"{str(val.dtype)[6:]}{list(val.shape)}" + ("meta" if val.is_meta else "")
    else:
        desc = repr(val)[:20]
    return f"{fn}-{arg}-{desc}"


def assert_bad_input_raises(row, funcs=PUBLIC_FUNCS):
    """row = (function, argument to replace, new value or f(base dict) -> value, exception,
    match): the call raises the exception, its message names the argument and says more."""
    fn_name, arg, val, exc, match = row
    fn, base = funcs[fn_name]
    kwargs = base()
    if callable(val) and not isinstance(val, torch.Tensor):
        val = val(kwargs)
    kwargs[arg] = val
    with pytest.raises(exc, match=match) as info:
        fn(**kwargs)
    msg = str(info.value)
    assert msg.split(":")[0].strip() == match or match in msg
    assert len(msg) > len(match) + 10  # says what was expected / given


# ------------------------------------------------------------------ torch.distributed
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def group1():
    """A 1-process gloo group, destroyed after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", world_size=1, rank=0,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


@contextlib.contextmanager
def exclusive_cores():
    """Held while a test runs processes of its own (gloo ranks, torchrun): under
    pytest-xdist (`make test` runs `pytest -n auto`) one worker at a time launches them, so
    that the ranks of one test never share the cores with another worker's ranks (on 2
    cores, 4 ranks at once time out). The lock is the run's (xdist's run id), a file in the
    temporary folder."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"solo{os.getpid()}")
    path = os.path.join(tempfile.gettempdir(), f"ppo_kernels_tests_{run}.lock")
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with --dist loadgroup, the tests that read the session's one
    2-process launch (the two_ranks fixture) go to one worker, so it launches once."""
    for item in items:
        if "two_ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("two_ranks"))


def run_ranks(script, out, n=2, timeout=180):
    """Runs ``python script RANK PORT OUT`` as n processes (a gloo group the script makes)
    and returns the ranks' OUT/rank<r>.json dicts, in rank order (one launch at a time
    over the xdist workers: exclusive_cores)."""
    with exclusive_cores():
        return _run_ranks(script, out, n, timeout)


def _run_ranks(script, out, n, timeout):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for r in range(n)]
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-4000:]
    finally:
        for p in procs:  # (a rank left waiting in a collective)
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory):
    """The results of tests/two_rank_cases.py on 2 gloo processes (one launch per session):
    a list of the ranks' {case: result} dicts."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "two_rank_cases.py")
    return run_ranks(script, tmp_path_factory.mktemp("tp2"))


def raises_naming(fn, name, types=(ValueError, TypeError)):
    """fn() raises one of types (exactly those, not a subclass such as IndexError: the
    exception's type must be ValueError or TypeError) naming ``name``."""
    with pytest.raises(Exception) as info:
        fn()
    e = info.value
    assert type(e) in types, f"expected ValueError / TypeError naming {name!r}, got " \
                             f"{type(e).__name__}: {e}"
    assert name in str(e), f"the message does not name {name!r}: {e}"
    return e


# ------------------------------------------------------------------ the raw Triton ops
# Helpers of the tests that call ppo_kernels::triton_* directly (test_triton_kernels.py
# and the raw-op tests beside their backend-parametrised siblings): on CUDA when a device
# is present, else on CPU tensors under the interpreter, whose 32-wide vocabulary block and
# 8-long GAE chunk (ppo_kernels/triton_kernels/_config.py) V = 100, 257 and T = 20 cross.

TRITON_DEVICE = "cuda" if HAS_CUDA_DEVICE else "cpu"
# (on CPU the raw ops run under the interpreter: skipped where it is broken, with its reason)
triton_ops = pytest.mark.skipif(
    not TRITON_OK or bool(INTERP_BROKEN),
    reason=INTERP_BROKEN or "ppo_kernels.triton_kernels.library does not import")
KL_CODES = ("k1", "k2", "k3", "abs", "k1+", "k3+")  # index = the kl_estimator code of the ops
# numpy (the interpreter) warns about overflows to -inf that some inputs produce on purpose
GENUINE_INF = pytest.mark.filterwarnings("ignore::RuntimeWarning")


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


# per-token outputs are accumulated in float32 (float64) whatever the logits' dtype, and the
# reference sees the same (rounded) logits: they match tightly even for bf16/fp16 logits.
TOK_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-5, 1e-6),
           torch.float16: (1e-5, 1e-6), torch.float64: (1e-10, 1e-12)}


def grad_tol(dtype, expected):
    """dlogits come back in the logits' dtype: bf16 keeps 8 bits, fp16 11."""
    scale = float(np.abs(expected).max()) if np.size(expected) else 1.0
    rtol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3,
            torch.float64: 1e-10}[dtype]
    return rtol, rtol * max(scale, 1e-30) * 0.1


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


def _opt(inp, key, acc):
    """per_token of inp[key], or None."""
    x = inp.get(key)
    return None if x is None else per_token(x, acc)


def slot_args(eps_low, eps_high, dual, kl_coef, kl_est, ent_coef, temp, grad_scale,
              policy_loss, tau_pos, tau_neg, kl_bias):
    """(scalars, codes) of the ppo_loss ops, by slot name (ppo_kernels/spec.py)."""
    f = dict(clip_eps_low=eps_low, clip_eps_high=eps_high, dual_clip_c=dual, kl_coef=kl_coef,
             entropy_coef=ent_coef, temperature=temp, grad_scale=grad_scale,
             sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
    i = dict(policy_loss=policy_loss, kl_estimator=kl_est, kl_bias_correction=int(kl_bias))
    return [float(f[n]) for n in FLOAT_SLOTS], [int(i[n]) for n in INT_SLOTS]


def run_ppo(logits, tokens, mask, inp, *, eps_low=0.2, eps_high=0.28, dual=0.0,
            kl_coef=0.1, kl_est=2, ent_coef=0.01, temp=1.0, grad_scale=1.0,
            compute_grad=True, policy_loss=0, tau_pos=1.0, tau_neg=1.05, kl_bias=False):
    """ppo_kernels::triton_ppo_loss_fwd on ppo_inputs' inp (codes as the ops take them):
    (loss, loss_tok, logprobs, entropy, dlogits)."""
    acc = inp["acc"]
    return torch.ops.ppo_kernels.triton_ppo_loss_fwd(
        logits, tokens, mask, _opt(inp, "old", acc), per_token(inp["adv"], acc),
        per_token(inp["w"], acc), _opt(inp, "ref", acc), _opt(inp, "isw", acc),
        _opt(inp, "went", acc), *slot_args(eps_low, eps_high, dual, kl_coef, kl_est, ent_coef,
                                           temp, grad_scale, policy_loss, tau_pos, tau_neg,
                                           kl_bias), compute_grad)


def ref_ppo(logits, tokens, mask, inp, *, eps_low=0.2, eps_high=0.28, dual=0.0,
            kl_coef=0.1, kl_est=2, ent_coef=0.01, temp=1.0, mode="token-mean"):
    """The reference's (loss, per-token loss, dlogits) for run_ppo's arguments."""
    loss, metrics, dl = ref.ppo_loss(
        logits, tokens, inp["old"], inp["adv"], mask, inp["ref"], clip_eps_low=eps_low,
        clip_eps_high=eps_high, dual_clip_c=dual if dual > 0 else None,
        kl_coef=kl_coef if inp["ref"] is not None else 0.0, kl_estimator=KL_CODES[kl_est],
        entropy_coef=ent_coef, temperature=temp, loss_agg_mode=mode,
        rollout_is_weights=inp["isw"])
    # per-token loss: loss_agg_mode "none" gives it (0 on masked positions)
    loss_tok, _, _ = ref.ppo_loss(
        logits, tokens, inp["old"], inp["adv"], mask, inp["ref"], clip_eps_low=eps_low,
        clip_eps_high=eps_high, dual_clip_c=dual if dual > 0 else None,
        kl_coef=kl_coef if inp["ref"] is not None else 0.0, kl_estimator=KL_CODES[kl_est],
        entropy_coef=ent_coef, temperature=temp, loss_agg_mode="none",
        rollout_is_weights=inp["isw"])
    return loss, loss_tok, dl


def check_ppo(out, rout, logits, tokens, mask, dtype, temp=1.0):
    """run_ppo's outputs against ref_ppo's (TOK_TOL, grad_tol): dtypes, shapes, values."""
    loss, loss_tok, logp, ent, dl = out
    rloss, rloss_tok, rdl = rout
    rtol, atol = TOK_TOL[dtype]
    acc = acc_of(dtype)
    assert loss.dim() == 0 and loss.dtype == loss_tok.dtype == logp.dtype == acc
    assert_close_np(loss_tok, rloss_tok, rtol, atol, what="loss_tok")
    assert_close_np(loss, rloss, rtol, atol, what="loss")
    rl, re_ = ref.token_logprobs(logits, tokens, mask, temp)
    assert_close_np(logp, rl, rtol, atol, what="logprobs")
    assert_close_np(ent, re_, rtol, atol, what="entropy")
    assert dl.shape == logits.shape and dl.dtype == logits.dtype and dl.is_contiguous()
    assert_close_np(dl, rdl, *grad_tol(dtype, rdl), what="dlogits")


def rel_err(actual, expected):
    """max |actual - expected| / |expected| (entry by entry)."""
    a = actual.detach().cpu().double().numpy() if torch.is_tensor(actual) else actual
    e = np.asarray(expected, dtype=np.float64)
    return float(np.max(np.abs(a - e) / np.maximum(np.abs(e), 1e-300)))


def expm1_minus_x64(u):
    """e^u - 1 - u in float64 to ~1e-16 relative: a 25-term series below |u| = 0.5."""
    u = np.asarray(u, dtype=np.float64)
    s = np.zeros_like(u)
    term = u * u / 2.0
    for k in range(3, 28):
        s += term
        term = term * u / k
    return np.where(np.abs(u) < 0.5, s, np.expm1(u) - u)


def k3_deltas(n, seed):
    """float32 deltas log-uniform in [1e-6, 20], both signs, plus the edges."""
    gen = np.random.default_rng(seed)
    mag = np.exp(gen.uniform(np.log(1e-6), np.log(20.0), n))
    edges = np.array([1e-6, 1e-4, 0.5, 1.0 - 2**-24, 1.0, 1.0 + 2**-23, 2.0, 20.0])
    d = np.concatenate([mag, edges])
    return np.concatenate([d, -d]).astype(np.float32)
