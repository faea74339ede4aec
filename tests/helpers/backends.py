"""The backends the tests run, what this machine can run, and the test tables' constants.

Backends (DESIGN.md): "cpu" and "torch" always run, on CPU tensors. "triton" runs on CPU
tensors under the Triton interpreter (TRITON_INTERPRET=1, set below before anything
imports triton) at small shapes only, when ppo_kernels.triton_kernels.library imports.
"cuda" and "triton_cuda" run on CUDA tensors only when a CUDA device is present (and the
extension was built with CUDA for "cuda"); otherwise they are skipped, never passed.
Every backend id contains the backend's name, so `pytest -k cuda` / `-k triton` select
them. The raw Triton ops (ppo_kernels::triton_*) run on CUDA when a device is present,
else on CPU tensors under the interpreter."""

import os

import torch

# before anything imports triton: with no GPU the Triton backend runs under its interpreter
# (conftest.py imports this module first)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import importlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ppo_kernels as pk  # noqa: E402
from ppo_kernels import testing  # noqa: E402

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

    from helpers import triton_interpreter  # noqa: E402

    triton_interpreter.install()  # the same bits in less time: about 0.6x, then 0.64x of that for
    # the suite's Triton cases with its memos, and 0.67x of that with its operands shortcut
    # (its docstring)

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
# the policy losses and the fused kernels' (token-level) ones: the public testing API's
# lists (ppo_kernels.testing, from spec.py), as lists so that tests can extend them
POLICY_LOSSES = list(testing.POLICY_LOSSES)
TOKEN_LOSSES = list(testing.KERNEL_POLICY_LOSSES)
# the losses without a dual clip / ratio cap (dual_clip_c must be None)
NO_DUAL_CLIP = ("cispo", "sapo", "vespo")



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


# ------------------------------------------------------------------ the raw Triton ops
# Helpers of the tests that call ppo_kernels::triton_* directly (test_triton_kernels.py
# and the raw-op tests beside their backend-parametrised siblings): on CUDA when a device
# is present, else on CPU tensors under the interpreter, whose 32-wide vocabulary block and
# 8-long GAE chunk (triton_kernels/_config.py) V = 100, 257 and T = 20 cross.

TRITON_DEVICE = "cuda" if HAS_CUDA_DEVICE else "cpu"
# (on CPU the raw ops run under the interpreter: skipped where it is broken, with its reason)
triton_ops = pytest.mark.skipif(
    not TRITON_OK or bool(INTERP_BROKEN),
    reason=INTERP_BROKEN or "ppo_kernels.triton_kernels.library does not import")
KL_CODES = ("k1", "k2", "k3", "abs", "k1+", "k3+")  # index = the kl_estimator code of the ops
# numpy (the interpreter) warns about overflows to -inf that some inputs produce on purpose
GENUINE_INF = pytest.mark.filterwarnings("ignore::RuntimeWarning")

