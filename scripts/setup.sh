#!/usr/bin/env bash
# Sets up the project on a fresh machine, and does nothing that is already done:
#
#   scripts/setup.sh demo   .venv with torch 2.14.1 and the demo's packages
#                           (requirements-demo.txt), the CPU kernels for this processor
#                           alone (PPO_KERNELS_CPU_CAPABILITIES=native, no CUDA): what
#                           `make demo` runs
#   scripts/setup.sh test   the same, plus the test packages (requirements.txt, verl without
#                           its dependency tree, DeepSpeed) and the whole build (the CUDA
#                           kernels when nvcc 13.x is there, every CPU SIMD variant): what
#                           `make test` and CI run
#
# torch 2.14.1 is a CUDA 13.0 build that also runs on the CPU; it matches the nvcc 13.0 of
# the build machines. Each step runs only when its inputs changed since it last ran (a stamp
# in .venv per step); the build is ninja's, which keeps its objects in build/ and recompiles
# only what changed (ccache too, where it is installed). Installing into an environment of
# your own needs none of this: README, "Install into your own environment".
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-test}
case "$MODE" in demo|test) ;; *) echo "usage: $0 [demo|test]" >&2; exit 2 ;; esac
PY=${PYTHON:-python3}
T0=$SECONDS
# .venv's modules keep their bytecode once imported (Makefile, PYTHONDONTWRITEBYTECODE)
unset PYTHONDONTWRITEBYTECODE

step() { printf '[setup %3ss] %s\n' "$((SECONDS - T0))" "$*"; }
# pip without the local mirror's "Location ... is ignored" lines, keeping pip's status
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; return "${PIPESTATUS[0]}"; }
digest() { cat "$@" | sha256sum | cut -d' ' -f1; }
# stamp NAME DIGEST: whether step NAME last ran with these inputs
current() { [ -f ".venv/.stamp-$1" ] && [ "$(cat ".venv/.stamp-$1")" = "$2" ]; }
done_with() { echo "$2" > ".venv/.stamp-$1"; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv ($("$PY" --version))"
  "$PY" -m venv .venv
fi
# Packages are installed with uv (from PyPI, into .venv) where it can be had: it unpacks
# torch and its CUDA libraries in parallel and links them from its cache, ~35 s for what
# pip takes 2.5 min over, and a second environment with the same torch (CI's wheel check)
# in about a second. pip is the fallback.
if [ ! -x .venv/bin/uv ]; then
  quiet .venv/bin/python -m pip install -q uv || true
fi
INSTALL=(bash scripts/pip_install.sh .venv/bin/python)  # (uv if it is there, else pip)
installer=$([ -x .venv/bin/uv ] && echo uv || echo pip)

req=$(digest requirements-demo.txt)
if ! current demo-packages "$req"; then
  step "installing torch 2.14.1 and the demo's packages (requirements-demo.txt, with" \
    "$installer; about 1 min on a fresh machine, mostly torch's CUDA libraries)"
  quiet "${INSTALL[@]}" -r requirements-demo.txt
  done_with demo-packages "$req"
fi

# The build: `make demo` compiles the CPU kernels for this processor alone; `make test`
# every variant and the CUDA kernels. A full build serves the demo too.
sources=$(find csrc -type f | LC_ALL=C sort | xargs cat setup.py pyproject.toml | sha256sum | cut -d' ' -f1)
built() {
  ls ppo_kernels/_C*.so > /dev/null 2>&1 && { current build "full $sources" || \
    { [ "$MODE" = demo ] && current build "demo $sources"; }; }
}
build() {
  if command -v ccache > /dev/null 2>&1; then
    export CC="ccache ${CC:-gcc}" CXX="ccache ${CXX:-g++}" PYTORCH_NVCC="ccache nvcc"
  fi
  if [ "$MODE" = demo ]; then
    step "building the CPU kernels for this processor (about 1 min on 2 cores; the other" \
      "SIMD variants and the CUDA kernels come with \`make test\`)"
    export PPO_KERNELS_NO_CUDA=1 PPO_KERNELS_CPU_CAPABILITIES=native
  else
    step "building the extension: the CUDA kernels (with nvcc 13.x), the three CPU SIMD" \
      "variants, side by side (about 3.5 min on 2 cores from scratch; ninja reuses what an" \
      "earlier build left)"
  fi
  # one line per compiled file (ninja's [i/n] and the object), and setup.py's own notes
  .venv/bin/python -m pip install -v --no-build-isolation -e . 2>&1 | awk '
    /ppo_kernels setup:/ { sub(/^ +/, ""); if (!seen[$0]++) { print "  " $0; fflush() }; next }
    /^ *\[[0-9]+\/[0-9]+\]/ {
      sub(/^ +/, "")
      src = ""; ext = ""
      for (i = 2; i <= NF; i++) {
        if ($i ~ /\/csrc\/.*\.(cpp|cu)$/) { src = $i; sub(/.*\/csrc\//, "csrc/", src) }
        if ($i ~ /\/cuda_units\/unit[0-9]+\.cu$/) { src = $i; sub(/.*\/cuda_units\//, "CUDA unit ", src) }
        if ($i ~ /\/temp\/[^\/]+\//) { ext = $i; sub(/.*\/temp\//, "", ext); sub(/\/.*/, "", ext) }
      }
      if (src != "") { printf "  %s %s %s\n", $1, ext, src; fflush() }
      next }
    /^ERROR|error:|Error/ { print; fflush() }'
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "the build failed: run .venv/bin/python -m pip install -v --no-build-isolation -e . for the whole log" >&2; return 1; }
  if [ "$MODE" = demo ]; then done_with build "demo $sources"; else done_with build "full $sources"; fi
}
# test_packages: what `make test` adds (requirements.txt, verl without its dependency
# tree, DeepSpeed); verl's check that our loss modes register waits for the build (it
# imports the compiled modules the build writes)
test_packages() {
  step "installing the test packages (requirements.txt: pytest, hypothesis, TRL; under a minute)"
  quiet "${INSTALL[@]}" -r requirements.txt
  # verl for its integration tests, without its dependency tree (scripts/install_verl.sh)
  step "installing verl 0.9.1 without its dependency tree (under a minute)"
  quiet bash scripts/install_verl.sh install
  # DeepSpeed for the ZeRO-3 tests of the LM head (tests/test_lm_head.py): a source
  # package whose build imports torch, hence --no-build-isolation; its ops compile at
  # first use (DS_BUILD_OPS=0), none of which the CPU tests use
  step "installing DeepSpeed 0.19.8 (its ops are compiled at first use: none here)"
  DS_BUILD_OPS=0 quiet "${INSTALL[@]}" --no-build-isolation deepspeed==0.19.8
}

# The packages are mostly downloads and unpacking, the build is the compiler on every
# core: with both to do, the build runs while the test packages install (it needs only
# torch, ninja and setuptools, from the demo's packages).
treq=$(digest requirements.txt requirements-demo.txt scripts/install_verl.sh scripts/setup.sh \
  scripts/pip_install.sh)
need_packages=$([ "$MODE" = test ] && ! current test-packages "$treq" && echo 1 || true)
if built; then
  step "ppo_kernels extension up to date"
  [ -z "$need_packages" ] || test_packages
elif [ -n "$need_packages" ]; then
  build & pid=$!
  trap 'kill "$pid" 2> /dev/null || true' EXIT  # (a failed install stops the build too)
  test_packages
  wait "$pid" || exit 1
  trap - EXIT
else
  build
fi
if [ -n "$need_packages" ]; then
  quiet bash scripts/install_verl.sh check
  done_with test-packages "$treq"
fi
.venv/bin/python -c "import ppo_kernels as pk; i = pk.build_info(); print('[setup] ppo_kernels built:', i['built'], '| CPU', i['cpu_capability'], 'of', i['cpu_capabilities_built'], '| CUDA', i['cuda'], '| from', i['path'])"
step "set-up done ($MODE)"
