# The two commands of the README:
#   make demo   set up what the demo needs on a fresh machine and run the PPO demo
#   make test   set everything up and run the test suite
# Each set-up step runs only when its inputs changed (scripts/setup.sh).
.PHONY: setup setup-demo demo test test-capabilities bench report check-install mutate

PY = .venv/bin/python

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
# capabilities this machine can force (ATen and the CPU kernels both follow
# ATEN_CPU_CAPABILITY): what `make test` checks on an AVX2 or a plain x86-64 CPU. Not the
# torch.compile tests: inductor's C++ code generation under a forced lower capability is
# torch's own (torch 2.14 fails its bounds check in a vectorised tail under avx2 and does
# not compile under default), and our kernels are not in it.
CAPABILITY_TESTS = tests/test_golden.py tests/test_reference.py tests/test_loss.py \
  tests/test_loss_precision.py tests/test_loss_token_logprobs.py tests/test_seed_sheet.py \
  tests/test_batch_invariance.py tests/test_distill.py tests/test_distill_tp.py
# A capability equal to this processor's own is skipped: `make test` ran the same code.
test-capabilities: setup
	native=$$($(PY) -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())"); \
	for cap in avx2 default; do \
	  if [ "$$cap" = "$$native" ]; then \
	    echo "== ATEN_CPU_CAPABILITY=$$cap: this processor's own, run by make test"; continue; \
	  fi; \
	  echo "== ATEN_CPU_CAPABILITY=$$cap"; \
	  ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q -n auto --dist loadgroup \
	    -k "not triton and not compile" $(CAPABILITY_TESTS) || exit 1; \
	done

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
