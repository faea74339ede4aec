"""The test suite's shared helpers (conftest.py keeps only the fixtures and hooks).

backends.py: the backends, what this machine can run, the test tables' constants;
inputs.py: seeded random inputs; asserts.py: comparisons, tolerances, rel_err;
raw_ops.py: the kernel ops' slot arguments and the raw Triton op runner;
bad_inputs.py: the bad-input tables' base calls; ranks.py: the multi-process launcher and
the rank scripts' runner; child.py: a check run in a fresh Python process.

tests/ is on sys.path (pytest's rootdir conftest, or the script's own folder for the rank
scripts), so test files and rank scripts import ``helpers.<module>``."""
