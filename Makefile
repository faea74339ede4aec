# The two commands of the README:
#   make demo   set everything up on a fresh machine and run the PPO demo (the main job)
#   make test   set everything up and run the test suite
.PHONY: setup demo test bench report check-install

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/python examples/ppo_demo.py --out out/ppo_demo.png

test: setup
	.venv/bin/python -m pytest -q --durations=10

bench: setup
	.venv/bin/python benchmarks/cpu_bench.py

# CPU benchmarks of every op over sizes: CSV and plots in benchmarks/results/ (~10 min);
# REPORT_ARGS="--quick" for a smoke run
report: setup
	.venv/bin/python benchmarks/report.py $(REPORT_ARGS)

# CI's install checks (after make test): the wheel installed into a second venv with the
# same torch, and the oldest supported torch, each running a fast subset of the tests
check-install: setup
	bash scripts/check_install.sh all
