#!/usr/bin/env bash
# The install checks CI runs after `make test` (.ci/run): ppo-kernels installed the way a
# user installs it, into virtual environments that hold only torch and numpy (plus the test
# runner), with no build variable set, and tested from a copy of tests/ outside the
# checkout, so that `import ppo_kernels` can only be the installed copy (checked).
#
#   wheel   `python -m build --wheel --no-isolation` in .venv (make test's environment: ninja
#           reuses the objects of its editable build, so this mostly links), the wheel's
#           metadata checked (torch pinned to the build's, only ppo_kernels at the top
#           level, _build_meta.py inside); a second venv with the same torch installs it
#           and runs the smoke check and WHEEL_TESTS.
#   oldest  a venv with the oldest torch the project claims (setup.py's OLDEST_TORCH; a CUDA
#           12 build there, so with nvcc 13 this is also the "no matching toolkit" path: a
#           CPU-only build that says why), `pip install --no-build-isolation <checkout>`
#           (this processor's CPU kernels: the wheel check builds every SIMD level),
#           then the smoke check, FAST_TESTS and TRACE_TESTS (less TRACE_LESS).
#   middle  a venv with torch MIDDLE_TORCH (the first GPU image's), this processor's CPU
#           kernels alone, the smoke check and TRACE_TESTS (less TRACE_LESS).
#
# With all, the oldest and middle venvs are filled in the background while the wheel check
# builds and tests (their installs wait on the disk and the network more than the cores).
#
# Usage: scripts/check_install.sh [wheel|oldest|middle|all] (default all). KEEP_VENVS=1 keeps the
# temporary venvs (5 GB each) and prints where they are.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHAT=${1:-all}
PY=${PYTHON:-python3}
# the named fast subset: the CPU kernels against the reference, the loader and setup.py;
# none needs TRL, verl or transformers
FAST_TESTS="tests/test_reference.py tests/test_loss.py tests/test_loss_token_logprobs.py
  tests/test_seed_sheet.py tests/test_extension.py tests/test_install.py"
# the wheel's own: it links the objects of make test's build (ninja reuses them), so the
# kernels' numbers are the ones make test checked; what the wheel adds is the install (the
# loader, the build metadata, the import from site-packages), which these check
WHEEL_TESTS="tests/test_extension.py tests/test_install.py tests/test_seed_sheet.py"
# what differs between torch releases: torch.compile (fullgraph, dynamic), opcheck of every
# registered op, the operator schemas and torch.jit.trace
TRACE_TESTS="tests/test_tracing.py tests/test_autograd_contract.py tests/test_autograd_opcheck.py"
# TRACE_LESS: in the oldest and middle venvs TRACE_TESTS run without torch.compile of the
# eager composite (backend "torch": inductor's code for torch's own ops, 54 s of the compile
# contract's 93 s of test time), which make test runs under CI's torch. What differs between
# releases in our code (dynamo tracing ppo_loss's Python, the ops' fake kernels and autograd
# formulas) the cpu backend's compile cases check.
TRACE_LESS="--deselect tests/test_autograd_contract.py::test_compile_dynamic_matches_eager[vanilla-torch]
  --deselect tests/test_autograd_contract.py::test_compile_dynamic_matches_eager[gspo-torch]"
# a torch release between the oldest and CI's own (the one of the first GPU image), for
# TRACE_TESTS: CPU kernels of this processor only (the tests need no more)
MIDDLE_TORCH=2.11
TMP=$(mktemp -d /tmp/ppo-kernels-install.XXXXXX)
declare -A PREPARING  # NAME -> the pid of prepare_NAME running in the background
cleanup() {
  # a venv still filling in the background (a check failed first) stops before its folder goes
  local pid
  for pid in "${PREPARING[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ "${KEEP_VENVS:-0}" = 1 ]; then echo "kept: $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
# nothing from the caller's environment steers the builds below; the venvs' modules keep
# their bytecode (Makefile, PYTHONDONTWRITEBYTECODE)
unset CUDA_HOME CUDA_PATH TORCH_CUDA_ARCH_LIST MAX_JOBS PPO_KERNELS_NO_CUDA \
  PPO_KERNELS_NO_EXTENSION PYTHONPATH PYTHONDONTWRITEBYTECODE

# install VENV PACKAGES...: scripts/pip_install.sh (uv from .venv, whose cache holds .venv's
# torch already, else the venv's pip)
install() {
  local venv=$1
  shift
  quiet nice -n 10 bash "$ROOT/scripts/pip_install.sh" "$venv/bin/python" "$@"
}
# quiet: the command's output without the local mirror's "Location ... is ignored" lines,
# and the command's own exit status
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }
minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }

# smoke_and_tests VENV [TESTS]: from a folder outside the checkout, check that ppo_kernels
# is the installed copy, run ppo_loss forward and backward on the CPU kernels against the
# reference, then TESTS (default FAST_TESTS)
smoke_and_tests() {
  local venv=$1 tests=${2:-$FAST_TESTS} work
  work=$(mktemp -d "$TMP/tests.XXXXXX")
  cp -r "$ROOT/tests" "$work/"
  printf '[pytest]\naddopts = -ra\nmarkers =\n    slow: larger shapes\n    gpu: needs a CUDA device\n' \
    > "$work/pytest.ini"
  (cd "$work" && nice -n 10 "$venv/bin/python" - <<'PYEOF'
import sysconfig
import numpy as np
import torch
import ppo_kernels as pk
from ppo_kernels import reference as ref
site = sysconfig.get_paths()["platlib"]
assert pk.__file__.startswith(site), f"ppo_kernels imported from {pk.__file__}, not {site}"
info = pk.build_info()
print("ppo_kernels", pk.__file__)
print("build_info", info)
assert info["built"] and info["cpu"] and "cpu" in info["backends"], info
g = torch.Generator().manual_seed(0)
B, T, V = 3, 7, 257
logits = torch.randn(B, T + 1, V, generator=g, dtype=torch.float64, requires_grad=True)
tokens = torch.randint(0, V, (B, T), generator=g)
old = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2 - 5.0
adv = torch.randn(B, T, generator=g, dtype=torch.float64)
refl = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2 - 5.0
mask = torch.rand(B, T, generator=g) > 0.2
kw = dict(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, entropy_coef=0.01)
loss, _ = pk.ppo_loss(logits, tokens, old, adv, mask, ref_logprobs=refl, backend="cpu", **kw)
loss.backward()
r_loss, _, r_grad = ref.ppo_loss(logits.detach().numpy(), tokens.numpy(), old.numpy(),
                                 adv.numpy(), mask.numpy(), ref_logprobs=refl.numpy(), **kw)
err_l = abs(float(loss.detach()) - r_loss)
err_g = float(np.abs(logits.grad.numpy() - r_grad).max())
print(f"smoke: ppo_loss cpu float64 fwd+bwd vs reference: |dloss| {err_l:.1e}, |dgrad| {err_g:.1e}")
assert err_l < 1e-12 and err_g < 1e-12, (err_l, err_g)
PYEOF
  ) || return 1
  # shellcheck disable=SC2086
  # one xdist worker per core, as make test (--dist loadgroup: tests/conftest.py)
  (cd "$work" && nice -n 10 "$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto \
    --dist loadgroup $tests)
}

check_wheel() {
  local t0=$SECONDS dist="$TMP/dist" venv="$TMP/venv-wheel" torch_version
  echo "== wheel: python -m build --wheel --no-isolation (.venv)"
  torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
  nice -n 10 .venv/bin/python -m build --wheel --no-isolation --outdir "$dist" . > "$TMP/build.log" 2>&1 \
    || { tail -50 "$TMP/build.log"; return 1; }
  local whl
  whl=$(ls "$dist"/ppo_kernels-*.whl)
  echo "built $(basename "$whl") in $(minutes $((SECONDS - t0))) min"
  .venv/bin/python - "$whl" "$torch_version" <<'PYEOF'
import sys, zipfile
whl, torch_version = sys.argv[1:]
z = zipfile.ZipFile(whl)
names = z.namelist()
tops = {n.split("/")[0] for n in names}
assert {t for t in tops if not t.endswith(".dist-info")} == {"ppo_kernels"}, tops
assert "ppo_kernels/_build_meta.py" in names and any(n.startswith("ppo_kernels/_C.") for n in names)
# the top-level triton_kernels/ of the checkout, inside the package (pyproject.toml package-dir)
assert "ppo_kernels/triton_kernels/library.py" in names, sorted(names)[:20]
meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
reqs = [l for l in meta.splitlines() if l.startswith("Requires-Dist: torch")]
assert reqs == [f"Requires-Dist: torch=={torch_version}"], reqs
print("wheel metadata:", reqs[0], "| top level:", sorted(tops))
PYEOF
  echo "== wheel: a second venv with torch $torch_version installs it"
  "$PY" -m venv "$venv"
  install "$venv" "torch==$torch_version" numpy
  install "$venv" "$whl[test]"
  smoke_and_tests "$venv" "$WHEEL_TESTS"
  echo "== wheel: a user's CI file (examples/user_ci, ppo_kernels.testing) from outside the checkout"
  local user
  user=$(mktemp -d "$TMP/user_ci.XXXXXX")
  cp "$ROOT/examples/user_ci/test_my_config.py" "$user/"
  (cd "$user" && nice -n 10 "$venv/bin/python" -m pytest -q -p no:cacheprovider test_my_config.py)
  echo "== wheel check: $(minutes $((SECONDS - t0))) min"
}

# the oldest torch the project claims: setup.py's OLDEST_TORCH, as "2.6"
oldest_torch() {
  "$PY" -c "import ast, re; src = open('setup.py').read(); \
print('.'.join(map(str, ast.literal_eval(re.search(r'^OLDEST_TORCH = (.+)$', src, re.M).group(1)))))"
}

# the test runner and its plugins: pyproject.toml's `test` extra, as words for install
# (read there, where the wheel check's "$whl[test]" takes them from too)
test_tools() {
  "$PY" -c "import ast, re; src = open('pyproject.toml').read(); \
print(' '.join(ast.literal_eval(re.search(r'^test = (\[.+\])$', src, re.M).group(1))))"
}

# installed VENV T0: what prepare_* says once its venv is filled
installed() {
  echo "torch $("$1/bin/python" -c 'import torch; print(torch.__version__)') and the test" \
    "tools installed in $(minutes $((SECONDS - $2))) min"
}

# prepare_oldest / prepare_middle: each venv and its packages (downloads and unpacking: the
# disk and the network more than the cores), which `all` runs in the background while the
# wheel check builds and tests
prepare_oldest() {
  local t0=$SECONDS venv="$TMP/venv-oldest" oldest
  oldest=$(oldest_torch)
  "$PY" -m venv "$venv"
  # setuptools >= 77 for pyproject.toml: torch 2.6 does not bring it on Python 3.11 (a
  # fresh venv has setuptools 65; torch 2.14 requires setuptools >= 77 itself)
  # ninja: setuptools compiles file after file without it (2.5 min here instead of 1)
  # shellcheck disable=SC2046
  install "$venv" "torch==$oldest.*" numpy "setuptools>=77" ninja $(test_tools)
  installed "$venv" "$t0"
}

check_oldest() {
  local t0=$SECONDS venv="$TMP/venv-oldest"
  echo "== oldest torch: a venv with torch==$(oldest_torch).*, pip install --no-build-isolation <checkout>"
  [ -d "$venv" ] || prepare_oldest
  # (this processor's CPU kernels: the default build of every SIMD level is the wheel check's)
  (cd "$TMP" && PPO_KERNELS_CPU_CAPABILITIES=native nice -n 10 "$venv/bin/python" -m pip \
    install -v --no-build-isolation "$ROOT" > "$TMP/build-oldest.log" 2>&1) \
    || { tail -50 "$TMP/build-oldest.log"; return 1; }
  grep "ppo_kernels setup:" "$TMP/build-oldest.log" | sort -u
  echo "built in $(minutes $((SECONDS - t0))) min"
  smoke_and_tests "$venv" "$FAST_TESTS $TRACE_TESTS $TRACE_LESS"
  echo "== oldest torch check: $(minutes $((SECONDS - t0))) min (after its venv)"
}

prepare_middle() {
  local t0=$SECONDS venv="$TMP/venv-middle"
  "$PY" -m venv "$venv"
  # numpy<2.4: torch 2.11 brings triton 3.6, whose interpreter (the Triton cases on CPU)
  # fails with NumPy 2.4 (https://github.com/triton-lang/triton/issues/9171); with it the
  # cases would only skip (tests/helpers/backends.py _interpreter_broken)
  # shellcheck disable=SC2046
  install "$venv" "torch==$MIDDLE_TORCH.*" "numpy<2.4" "setuptools>=77" ninja $(test_tools)
  installed "$venv" "$t0"
}

check_middle() {
  local t0=$SECONDS venv="$TMP/venv-middle"
  echo "== torch $MIDDLE_TORCH: a venv with torch==$MIDDLE_TORCH.*, this processor's CPU kernels, $TRACE_TESTS"
  [ -d "$venv" ] || prepare_middle
  (cd "$TMP" && PPO_KERNELS_NO_CUDA=1 PPO_KERNELS_CPU_CAPABILITIES=native nice -n 10 \
    "$venv/bin/python" -m pip install -v --no-build-isolation "$ROOT" \
    > "$TMP/build-middle.log" 2>&1) || { tail -50 "$TMP/build-middle.log"; return 1; }
  echo "built in $(minutes $((SECONDS - t0))) min"
  smoke_and_tests "$venv" "$TRACE_TESTS $TRACE_LESS"
  echo "== torch $MIDDLE_TORCH check: $(minutes $((SECONDS - t0))) min (after its venv)"
}

# background NAME: runs prepare_NAME with its output in $TMP/prepare-NAME.log
background() { "prepare_$1" > "$TMP/prepare-$1.log" 2>&1 & PREPARING[$1]=$!; }
# joined NAME: waits for it, prints its output, fails as it failed
joined() {
  local rc=0
  wait "${PREPARING[$1]}" || rc=$?
  unset "PREPARING[$1]"
  echo "== $1's venv (prepared in the background):"
  cat "$TMP/prepare-$1.log"
  return "$rc"
}
case "$WHAT" in
  wheel) check_wheel ;;
  oldest) check_oldest ;;
  middle) check_middle ;;
  # the two other venvs fill while the wheel check runs (about a minute saved on 2 cores)
  all) background oldest; background middle; check_wheel; joined oldest; check_oldest
    joined middle; check_middle ;;
  *) echo "usage: $0 [wheel|oldest|middle|all]" >&2; exit 2 ;;
esac
