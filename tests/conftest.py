"""Shared fixtures and helpers of the ppo_kernels test suite.

Backends (DESIGN.md): "cpu" and "torch" always run, on CPU tensors. "triton" runs on CPU
tensors under the Triton interpreter (TRITON_INTERPRET=1, set below before anything
imports triton) at small shapes only, when ppo_kernels.triton_kernels.library imports.
"cuda" and "triton_cuda" run on CUDA tensors only when a CUDA device is present (and the
extension was built with CUDA for "cuda"); otherwise they are skipped, never passed.
Every backend id contains the backend's name, so `pytest -k cuda` / `-k triton` select
them.

Test files import the helpers directly (`from conftest import ...`): tests/ has no
__init__.py, so pytest puts this directory on sys.path.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import importlib  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels import reference as ref  # noqa: E402

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

_SKIP_INTERP = not (TRITON_OK and INTERPRET and not HAS_CUDA_DEVICE)
_INTERP_REASON = ("triton interpreter unavailable (ppo_kernels.triton_kernels.library does not "
                  "import, TRITON_INTERPRET != 1, or a GPU is present and triton runs there)")


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


def make_mask(B, T, gen, padding="mixed"):
    """bool [B, T]. "mixed": rows cycle through left, right and interior padding (at least
    one valid token each), so every pattern appears whenever B >= 3."""
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
            raise AssertionError(kind)
    if padding == "empty_row":
        m[B // 2] = False
    if padding == "all":
        m[:] = False
    return m


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


def assert_close_np(actual, expected, *, rtol, atol, what=""):
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


def assert_metrics(metrics, expected, rtol=2e-6, atol=2e-6):
    assert set(metrics) == set(expected), set(metrics) ^ set(expected)
    for k, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0, k
        assert v.dtype == torch.float32, (k, v.dtype)
        assert not v.requires_grad, k
        assert_close_np(v, expected[k], rtol=rtol, atol=atol, what=f"metric {k}")
