# The two commands of the README:
#   make demo   set up what the demo needs on a fresh machine and run the PPO demo
#   make test   set everything up and run the test suite
# Each set-up step runs only when its inputs changed (scripts/setup.sh).
.PHONY: setup setup-demo demo test test-capabilities bench report check-install mutate

PY = .venv/bin/python

# Python writes each imported module's bytecode (__pycache__) the first time, and every
# later process reads it: with PYTHONDONTWRITEBYTECODE set (some CI images set it) every
# process compiled torch's, transformers' and the tests' sources again (~2 s for torch
# alone, and the suite starts ~100 processes). Only .venv and this checkout get the caches
# (__pycache__ is in .gitignore).
unexport PYTHONDONTWRITEBYTECODE

setup-demo:
	./scripts/setup.sh demo

setup:
	./scripts/setup.sh test

demo: setup-demo
	$(PY) examples/ppo_demo.py --out out/ppo_demo.png

# one pytest-xdist worker per core; --dist loadgroup keeps the tests that read one
# multi-process launch on one worker (tests/conftest.py; tests/helpers/ranks.py,
# exclusive_cores)
test: setup
	$(PY) -m pytest -q -n auto --dist loadgroup --durations=10

# The tests whose results depend on the CPU's SIMD level, again under the lower
# capabilities this machine can force (ATEN_CPU_CAPABILITY=avx2 and default, side by side):
# what `make test` checks on an AVX2 or a plain x86-64 CPU (scripts/test_capabilities.sh)
test-capabilities: setup
	bash scripts/test_capabilities.sh

bench: setup-demo
	$(PY) benchmarks/cpu_bench.py

# CPU benchmarks of every op over sizes, a grid of ppo-kernels-bench runs: CSV and plots in
# benchmarks/results/ (about an hour on 2 cores; --resume continues a run);
# REPORT_ARGS="--quick" for a smoke run
report: setup-demo
	$(PY) benchmarks/report.py $(REPORT_ARGS)

# CI's install checks (after make test): the wheel installed into a second venv with the
# same torch, and the oldest supported torch, each running a fast subset of the tests
check-install: setup
	bash scripts/check_install.sh all

# single-point mutations of the formula modules against the fast tier (docs/TESTING.md);
# on demand, outside CI's time
mutate: setup
	$(PY) scripts/mutate.py --all
